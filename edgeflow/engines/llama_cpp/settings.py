"""The llama_cpp backend's settings: its name and writer version, the engine.profile model, and how each family
maps to a GGUF architecture (names, RoPE kinds, the attention scale llama.cpp applies).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.model.architecture import Architecture


BACKEND = "llama_cpp"


# The writer's own version: bump it when what `build` writes changes (part of build_identity, the cache key).
WRITER = "edgeflow gguf writer 2"  # 2: per-family GGUF architectures


FORMAT = "gguf v3 (llama.cpp)"


GGUF_FILE = "model.gguf"


BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block


class Profile(BaseModel):
    """`engine.profile` of the llama_cpp backend (validated when the edgeflow profile loads)."""

    model_config = ConfigDict(extra="forbid")

    head: Literal["f32", "f16", "q8_0"] = Field(
        default="f32", description="Type of the token embedding table, which is also the lm_head when tied "
        "(llm-compressor leaves it dense): f32 (exact), f16, or q8_0 (re-quantized in blocks of 32 by the gguf "
        "package; llama.cpp's own Q4_0 files use q8_0 here). At 135M parameters the 49152x576 head is ~45% of the "
        "weights read per token.")
    dense: Literal["f32", "f16"] = Field(
        default="f32", description="Type of dense decoder linears: the FP reference row's, and a quantized checkpoint's "
        "built from its dequantized weights. f32 keeps them exact.")
    inexact_weights: Literal["dequantize", "error"] = Field(
        default="dequantize", description="Quantized weights no Q4_0/Q4_1/Q8_0 block holds (asymmetric int8, a group "
        "size that is not a multiple of 32, act-order groups): 'dequantize' builds them dense from their exact "
        "dequantized values (engine.json records it under 'dequantized'); 'error' refuses them.")
    n_ctx: int = Field(
        default=2048, ge=64, le=131072, description="Context (KV cache positions) of each llama.cpp context; a request "
        "whose prompt plus max_tokens exceed it gets a ValueError naming both. Capped at the model's context length.")
    n_batch: int = Field(
        default=512, ge=8, le=8192, description="Tokens per llama.cpp decode call during prefill and scoring "
        "(llama.cpp's default).")
    contexts: int = Field(
        default=2, ge=1, le=64, description="llama.cpp contexts kept per loaded engine, one per concurrent generation "
        "(each holds its own KV cache of n_ctx positions; the weights are shared). Set it to the server's slots.")


DEFAULT_PROFILE: dict[str, Any] = Profile().model_dump()


# What each family is written as: transformers model_type -> the llama.cpp GGUF architecture whose graph computes it
# (llama.cpp's own converter makes the same choices: Mistral is its Llama class). Tensor names come from the gguf
# package's per-architecture table (llama.cpp's tensor-name map), not from a table here.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3"}


# RoPE kinds each GGUF architecture's graph applies, per attention kind: `llama` reads per-dimension factors
# (rope_freqs, which express llama3 scaling) and a linear scale; qwen2/qwen3 a linear scale; gemma3 a linear scale on
# its global layers and its own base on the sliding ones; gemma2 one default table.
GGUF_ROPES = {"llama": {"default", "linear", "llama3"}, "qwen2": {"default", "linear"}, "qwen3": {"default", "linear"},
              "gemma2": {"default"}, "gemma3": {"default", "linear"}}


# GGUF architectures whose llama.cpp graph takes q/k in interleaved pairs (LLAMA_ROPE_TYPE_NORM): rows are permuted
# from Hugging Face's rotate-half order at build. The others are NEOX (rotate-half), as in Hugging Face.
INTERLEAVED_ROPE = {"llama"}


def gguf_arch(config: dict[str, Any]) -> str:
    """The GGUF architecture `config`'s family is written as (KeyError for a family this backend does not write)."""
    return GGUF_ARCH[config["model_type"]]


@lru_cache(maxsize=16)
def _name_map(arch: str, n_blocks: int) -> Any:
    import gguf

    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(kind, n_blocks)


def _gguf_name(hf: str, arch: str = "llama", n_blocks: int = 64) -> str:
    """The GGUF tensor name of a Hugging Face tensor in `arch` (ValueError naming it if llama.cpp's `arch` has none)."""
    name = _name_map(arch, n_blocks).get_name(hf, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"tensor {hf!r} has no place in a llama.cpp {arch!r} GGUF")
    return name


def llama_cpp_attn_scale(arch: Architecture, gguf: str) -> float:
    """The query scale llama.cpp's `gguf` graph applies: 1/sqrt(head_dim), except Gemma 2/3 at the 27B layer counts
    (46 / 62), where Google's reference uses 1/sqrt(hidden / heads) (llama.cpp src/models/gemma2.cpp, gemma3.cpp)."""
    if (gguf, arch.num_hidden_layers) in (("gemma2", 46), ("gemma3", 62)):
        return float(arch.hidden_size // arch.num_attention_heads) ** -0.5
    return float(arch.head_dim) ** -0.5
