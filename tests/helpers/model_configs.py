"""config.json fields of real released models, for the tests that count what they cost (edgeflow/estimate/): the
published checkpoints' sizes, without their weights."""
from __future__ import annotations

SMOLLM2_135M = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000, "hidden_act": "silu",
                "tie_word_embeddings": True}


def gemma3_270m() -> dict:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                            query_pre_attn_scalar=256, max_position_embeddings=32768).to_dict()


# Gemma-2-9B's config.json (google/gemma-2-9b-it): what the example names
GEMMA2_9B = {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 14336,
             "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
             "vocab_size": 256000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True}
