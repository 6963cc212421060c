"""Tiny random models of every family tasks/architecture.py describes, built from transformers' config classes.

Each one exercises what sets its family apart from Llama: llama3-scaled RoPE (Llama 3.x), a sliding window
shorter than the test prompts (Mistral, Gemma), q/k/v biases (Qwen2), q/k norms (Qwen3, Gemma 3), softcaps
tight enough to bite (Gemma 2), per-layer RoPE with linear scaling on the global layers (Gemma 3), an attention
scale other than head_dim**-0.5 (Gemma). transformers initialises biases to 0 and norms to 1 (0 for Gemma's
offset norms), which would hide a missing bias or norm: every norm and bias is perturbed.
"""
from __future__ import annotations

from pathlib import Path

VOCAB = 998
WINDOW = 8  # shorter than the tests' prompts, so the sliding layers really drop positions
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.08)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]

# model_type -> (config class name, model class name, extra config)
FAMILY_MODELS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": WINDOW, "layer_types": GEMMA_LAYERS,
                                                     "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                                                     "final_logit_softcapping": 5.0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": WINDOW, "layer_types": GEMMA_LAYERS, "query_pre_attn_scalar": 24,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}}),
}


def build_tiny(model_type: str, out: Path, seed: int = 0) -> Path:
    """Save a tiny random `model_type` model (perturbed norms and biases) to `out`; returns `out`."""
    import torch
    import transformers

    cfg_cls, model_cls, extra = FAMILY_MODELS[model_type]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    return out


def rtn_int4(dense: Path, out: Path, symmetric: bool = False, group_size: int = 64) -> Path:
    """An llm-compressor RTN int4 checkpoint of `dense` (every decoder Linear, lm_head kept)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group_size}
    recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe, output_dir=str(out), save_compressed=True)
    return out
