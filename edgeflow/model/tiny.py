"""Tiny random models of every family edgeflow/model/architecture.py describes, built from transformers' config classes:
what `edgeflow doctor` builds, quantizes and compiles on a host in seconds (no hub, no download), and what the tests
run every engine and stage on (tests/helpers/families.py adds the comparisons).

Each one exercises what sets its family apart from Llama: llama3-scaled RoPE (Llama 3.x), a sliding window
shorter than the test prompts (Mistral, Gemma), q/k/v biases (Qwen2), q/k norms (Qwen3, Gemma 3), softcaps
tight enough to bite (Gemma 2), per-layer RoPE with linear scaling on the global layers (Gemma 3), an attention
scale other than head_dim**-0.5 (Gemma). transformers initialises biases to 0 and norms to 1 (0 for Gemma's
offset norms), which would hide a missing bias or norm: every norm and bias is perturbed.
"""
from __future__ import annotations

from pathlib import Path

from edgeflow.paths import REPO_ROOT

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


# model_type -> (special tokens, at ids 0.., bos, eos, chat template): each family's own, so a tokenizer file, a GGUF's
# token table and a template see what the family's real tokenizer holds.
_LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
           "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
           "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
            "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% else %}"
            "{{ raise_exception('Mistral takes user and assistant roles only') }}{% endif %}{% endfor %}")
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_GEMMA_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
FAMILY_TOKENS: dict[str, tuple[list[str], str | None, str, str]] = {
    "llama": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
              "<|begin_of_text|>", "<|eot_id|>", _LLAMA3),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", _MISTRAL),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", _CHATML),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", _CHATML),
    "gemma2": (_GEMMA_TOKENS, "<bos>", "<end_of_turn>", "gemma3.jinja"),
    "gemma3_text": (_GEMMA_TOKENS, "<bos>", "<end_of_turn>", "gemma3.jinja"),
}
CORPORA = REPO_ROOT / "data" / "corpora"


def corpus_texts() -> list[str]:
    """Every string field of every record of the shipped corpora (data/corpora/*.jsonl), in file order: what the tiny
    tokenizers are trained on and `edgeflow doctor` distils with."""
    import json

    return [v for f in sorted(CORPORA.glob("*.jsonl")) for line in f.read_text().splitlines() if line.strip()
            for v in json.loads(line).values() if isinstance(v, str)]


def family_tokenizer(model_type: str, out: Path) -> Path:
    """A byte-level BPE tokenizer of VOCAB tokens trained on the shipped corpora, with `model_type`'s special tokens
    (ids 0..), bos/eos and chat template, saved to `out` (tokenizer.json and its config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, template = FAMILY_TOKENS[model_type]
    if template.endswith(".jinja"):
        template = (REPO_ROOT / "configs" / "chat_templates" / template).read_text()
    texts = corpus_texts()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[0],
                                   chat_template=template)
    fast.save_pretrained(out)
    return out


def build_tiny(model_type: str, out: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random `model_type` model (perturbed norms and biases; config `overrides` on top of its family's)
    with its family tokenizer to `out`; returns `out`."""
    import torch
    import transformers

    cfg_cls, model_cls, extra = FAMILY_MODELS[model_type]
    torch.manual_seed(seed)
    specials, bos, eos, _ = FAMILY_TOKENS[model_type]
    ids = {"bos_token_id": specials.index(bos) if bos else None, "eos_token_id": specials.index(eos),
           "pad_token_id": 0}
    cfg = getattr(transformers, cfg_cls)(**(COMMON | ids | extra | overrides))
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    family_tokenizer(model_type, out)
    return out
