"""What a model is: one typed description, read once from config.json, that every stage and engine backend reads.

    python -c "from edgeflow.model.architecture import describe; print(describe({'model_type': 'qwen2', 'hidden_size': 64, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'intermediate_size': 128, 'vocab_size': 100}).summary())"

A family is a description, not a fork: `FAMILIES` says, per transformers `model_type`, how that family differs from
a Llama decoder (norm offset, biases, q/k norms, activation, sandwich norms, embedding scale, attention scale,
softcaps, sliding-window layers, RoPE kinds), and `describe` turns one config.json, in any of the spellings
transformers 4.x and 5.x write, into an `Architecture`. Backends read the fields they implement; nothing else in the
tree reads `model_type` or the RoPE keys.

`BACKEND_FAMILIES` is the support matrix (README's "Model families" table is checked against it): per backend, the
families it runs, and for each one it refuses, why. `check_backend` raises, naming the family, the backend and the
backends that can run it; a config.json field no backend understands (an unknown `rope_type`, partial rotary,
a softcap on a family without one) is refused by `describe` itself, naming the field and its value. Nothing is ever
run as Llama because it looks like one.
"""
from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class Rope(BaseModel):
    """One RoPE table's parameters (transformers' `rope_parameters` for one attention kind)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["default", "linear", "llama3"] = Field(description="rope_type: 'default', 'linear' (positions / factor) "
                                                          "or 'llama3' (Llama 3.1+ frequency-dependent scaling).")
    theta: float = Field(gt=0, description="rope_theta: the base of the inverse frequencies.")
    factor: float | None = Field(default=None, description="factor ('linear', 'llama3'): how much the context is stretched.")
    low_freq_factor: float | None = Field(default=None, description="low_freq_factor ('llama3').")
    high_freq_factor: float | None = Field(default=None, description="high_freq_factor ('llama3').")
    original_max_position_embeddings: int | None = Field(
        default=None, description="original_max_position_embeddings ('llama3'): the context the model was pretrained on.")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """float32 [head_dim / 2]: the inverse frequencies, computed as transformers' ROPE_INIT_FUNCTIONS do (fp32)."""
        inv = (1.0 / (np.float32(self.theta) ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                                                 / np.float32(head_dim)))).astype(np.float32)
        if self.type == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.type == "llama3":
            factor, lo, hi, old = self.factor, self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / lo, old / hi
            wavelen = (2 * math.pi / inv).astype(np.float32)
            scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
            smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
            smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        return inv


class Family(BaseModel):
    """How a family's decoder layer differs from Llama's (the defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The family's name in errors, tables and engine.json (e.g. 'Qwen3').")
    architectures: tuple[str, ...] = Field(description="config.json `architectures` values this description covers.")
    norm_offset: float = Field(default=0.0, description="RMSNorm scales by (offset + w): 1 for Gemma, 0 otherwise. Folded "
                               "into the weights once at build by backends whose kernels scale by w.")
    qkv_bias: Literal["never", "always", "config"] = Field(
        default="config", description="q/k/v projection biases: Qwen2 always has them; 'config': attention_bias says.")
    o_bias: bool = Field(default=True, description="attention_bias also adds an o_proj bias (Llama, Qwen3), or never (Qwen2).")
    qk_norm: bool = Field(default=False, description="Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).")
    sandwich_norms: bool = Field(default=False, description="Four norms per layer: post-attention and pre/post-feedforward "
                                 "(Gemma 2/3); else two (input, post-attention = pre-MLP).")
    embed_scale: bool = Field(default=False, description="Embeddings multiplied by sqrt(hidden_size) (Gemma).")
    attn_scale_key: str | None = Field(default=None, description="Config key whose value v sets the attention scale "
                                       "v**-0.5 (Gemma's query_pre_attn_scalar); None: head_dim**-0.5.")
    softcaps: bool = Field(default=False, description="attn_logit_softcapping / final_logit_softcapping may be set (Gemma 2, 3).")
    per_layer_rope: bool = Field(default=False, description="Sliding and full layers use their own RoPE (Gemma 3).")
    sliding: Literal["none", "all", "layer_types"] = Field(
        default="layer_types", description="Which layers attend within `sliding_window`: 'all' when it is set (Mistral), or "
        "per `layer_types` ('sliding_attention').")
    act_key: str = Field(default="hidden_act", description="The config key naming the MLP activation.")
    chat_stops: tuple[str, ...] = Field(default=(), description="End-of-turn tokens of the family's chat template, stop "
                                        "tokens even when generation_config lists only the end-of-text one.")


LLAMA = Family(name="Llama", architectures=("LlamaForCausalLM",), sliding="none", chat_stops=("<|eot_id|>", "<|im_end|>"))
FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA.model_copy(update={"name": "Mistral", "architectures": ("MistralForCausalLM",), "sliding": "all",
                                        "chat_stops": ()}),
    "qwen2": LLAMA.model_copy(update={"name": "Qwen2", "architectures": ("Qwen2ForCausalLM",), "qkv_bias": "always",
                                      "o_bias": False, "sliding": "layer_types", "chat_stops": ("<|im_end|>",)}),
    "qwen3": LLAMA.model_copy(update={"name": "Qwen3", "architectures": ("Qwen3ForCausalLM",), "qk_norm": True,
                                      "sliding": "layer_types", "chat_stops": ("<|im_end|>",)}),
    "gemma2": Family(name="Gemma 2", architectures=("Gemma2ForCausalLM",), norm_offset=1.0, qkv_bias="config",
                     sandwich_norms=True, embed_scale=True, attn_scale_key="query_pre_attn_scalar", softcaps=True,
                     act_key="hidden_activation", chat_stops=("<end_of_turn>",)),
    "gemma3_text": Family(name="Gemma 3", architectures=("Gemma3ForCausalLM",), norm_offset=1.0, qkv_bias="config",
                          qk_norm=True, sandwich_norms=True, embed_scale=True, attn_scale_key="query_pre_attn_scalar",
                          softcaps=True, per_layer_rope=True, act_key="hidden_activation", chat_stops=("<end_of_turn>",)),
}
# Tokens that end a chat turn or a text in some family: the server stops at each one its vocabulary holds (base-model
# text ends with <|endoftext|> even when the chat eos is <|im_end|>; Gemma's turns end with <end_of_turn>).
END_TOKENS = tuple(dict.fromkeys([t for f in FAMILIES.values() for t in f.chat_stops] + ["<|endoftext|>", "<|end_of_text|>"]))
# Activations by config spelling -> the one kernels implement ('gelu_tanh': GELU, tanh approximation).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


class Architecture(BaseModel):
    """One model's decoder, as every stage and backend reads it (`describe(config)`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: str = Field(description="config.json model_type: the key of FAMILIES.")
    family: str = Field(description="FAMILIES[model_type].name.")
    hidden_size: int = Field(gt=0, description="Residual width.")
    intermediate_size: int = Field(gt=0, description="MLP width.")
    num_hidden_layers: int = Field(gt=0, description="Decoder layers.")
    num_attention_heads: int = Field(gt=0, description="Query heads.")
    num_key_value_heads: int = Field(gt=0, description="Key/value heads (GQA: divides the query heads).")
    head_dim: int = Field(gt=0, description="Width of one head (Gemma and Qwen3: independent of hidden_size).")
    vocab_size: int = Field(gt=0, description="Rows of the embedding and the head.")
    context_length: int = Field(gt=0, description="max_position_embeddings.")
    rms_norm_eps: float = Field(gt=0, description="RMSNorm epsilon.")
    norm_offset: float = Field(description="RMSNorm scale is (offset + w); 1 for Gemma.")
    activation: Literal["silu", "gelu_tanh"] = Field(description="MLP gate activation (SwiGLU or GeGLU).")
    qkv_bias: bool = Field(description="q/k/v projections carry biases.")
    o_bias: bool = Field(description="o_proj carries a bias.")
    mlp_bias: bool = Field(description="gate/up/down projections carry biases.")
    qk_norm: bool = Field(description="Per-head RMSNorm of q and k before RoPE.")
    sandwich_norms: bool = Field(description="Post-attention and pre/post-feedforward norms (four per layer).")
    embed_scale: float = Field(description="Embeddings are multiplied by this (sqrt(hidden) for Gemma, else 1).")
    attn_scale: float = Field(gt=0, description="Attention logits are q.k times this.")
    attn_softcap: float | None = Field(description="Attention logits -> cap * tanh(logit / cap) (Gemma 2).")
    final_softcap: float | None = Field(description="Output logits -> cap * tanh(logit / cap) (Gemma 2).")
    tie_word_embeddings: bool = Field(description="The head is the embedding table.")
    sliding_window: int | None = Field(description="Keys a sliding layer's query sees, itself included.")
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] = Field(description="Per layer: full or sliding attention.")
    rope: dict[str, Rope] = Field(description="RoPE per attention kind ('full_attention', 'sliding_attention'); both the "
                                  "same table unless the family gives sliding layers their own (Gemma 3).")

    def params(self, layers: int | None = None) -> int:
        """Parameters of this model with `layers` decoder layers (default: all of them): attention, MLP and norm
        weights per layer, the embedding, the head unless tied, the final norm."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * hd if self.qk_norm else 0)
        mlp = 3 * h * self.intermediate_size
        norms = h * (4 if self.sandwich_norms else 2)
        n = self.num_hidden_layers if layers is None else layers
        return n * (attn + mlp + norms) + self.embedding_params + h

    @property
    def embedding_params(self) -> int:
        """Parameters of the embedding and the head (one table when tied): what no layer cut removes."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to every earlier position."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def summary(self) -> dict[str, Any]:
        """What engine.json and the registry record (JSON-safe)."""
        return self.model_dump(mode="json")


def _rope_from(params: dict[str, Any], where: str, key: str) -> Rope:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"{where}: {key}.rope_type={kind!r} is not implemented (known: default, linear, llama3); "
                         "no backend would run this model's positions as trained")
    if "partial_rotary_factor" in params and float(params["partial_rotary_factor"]) != 1.0:
        raise ValueError(f"{where}: {key}.partial_rotary_factor={params['partial_rotary_factor']!r}: only full-width RoPE is implemented")
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                             "original_max_position_embeddings")}.get(kind, ())
    missing = [k for k in need if params.get(k) is None]
    if missing:
        raise ValueError(f"{where}: {key} (rope_type {kind!r}) lacks {missing}")
    if kind == "default" and params.get("factor") not in (None, 1, 1.0):
        raise ValueError(f"{where}: {key}.factor={params['factor']!r} with rope_type 'default'; name the scaling type")
    if params.get("attention_factor") not in (None, 1, 1.0):
        raise ValueError(f"{where}: {key}.attention_factor={params['attention_factor']!r}: only 1.0 is implemented")
    theta = params.get("rope_theta")
    if theta is None:
        raise ValueError(f"{where}: {key} names no rope_theta")
    return Rope(type=kind, theta=float(theta), **{k: params[k] for k in need})


def _ropes(config: dict[str, Any], fam: Family, where: str) -> dict[str, Rope]:
    """RoPE per attention kind from transformers 5's `rope_parameters` (flat, or keyed by layer type) or 4.x's
    `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} & set(params):
        if not fam.per_layer_rope:
            raise ValueError(f"{where}: rope_parameters per layer type is not part of the {fam.name} family")
        full = _rope_from(params.get("full_attention") or {}, where, "rope_parameters.full_attention")
        local = params.get("sliding_attention")
        return {"full_attention": full,
                "sliding_attention": _rope_from(local, where, "rope_parameters.sliding_attention") if local else full}
    if isinstance(params, dict) and params:
        full = _rope_from(params, where, "rope_parameters")
    else:
        merged = dict(config.get("rope_scaling") or {})
        merged.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        full = _rope_from(merged, where, "rope_scaling")
    local = full
    if fam.per_layer_rope:  # Gemma 3 (4.x spelling): sliding layers use rope_local_base_freq, unscaled
        local = Rope(type="default", theta=float(config.get("rope_local_base_freq", 10000.0)))
    return {"full_attention": full, "sliding_attention": local}


def describe(config: dict[str, Any], where: str = "config.json") -> Architecture:
    """The Architecture of one config.json; ValueError naming the field and value for anything not described here."""
    mt = config.get("model_type")
    if mt not in FAMILIES:
        known = ", ".join(f"{k} ({f.name})" for k, f in FAMILIES.items())
        raise ValueError(f"{where}: model_type={mt!r} is not a supported family (supported: {known}); "
                         "README, 'Model families', lists what each backend runs")
    fam = FAMILIES[mt]
    archs = [a for a in (config.get("architectures") or []) if a not in fam.architectures]
    if archs:
        raise ValueError(f"{where}: architectures={config.get('architectures')} with model_type={mt!r}: only "
                         f"{list(fam.architectures)} (a causal language model) is described")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(config.get(key), int):
            raise ValueError(f"{where}: {key} is missing or not an integer ({config.get(key)!r})")
    act_name = config.get(fam.act_key) or config.get("hidden_act") or "silu"
    if act_name not in ACTIVATIONS:
        raise ValueError(f"{where}: {fam.act_key}={act_name!r} is not implemented (known: {sorted(ACTIVATIONS)})")
    if fam.name.startswith("Gemma") and ACTIVATIONS[act_name] != "gelu_tanh":
        raise ValueError(f"{where}: {fam.act_key}={act_name!r}: Gemma's MLP is GeGLU (gelu_pytorch_tanh)")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    if heads % kv:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    n = config["num_hidden_layers"]
    attn_cap, final_cap = config.get("attn_logit_softcapping"), config.get("final_logit_softcapping")
    if (attn_cap or final_cap) and not fam.softcaps:
        raise ValueError(f"{where}: attn_logit_softcapping={attn_cap!r} / final_logit_softcapping={final_cap!r}: the "
                         f"{fam.name} family has no softcapping; remove the field")
    window = config.get("sliding_window")
    if fam.sliding == "none" and window:
        raise ValueError(f"{where}: sliding_window={window!r} is not part of the {fam.name} family")
    if fam.sliding == "all":
        types = ["sliding_attention" if window else "full_attention"] * n
    else:
        types = list(config.get("layer_types") or ["full_attention"] * n)
        if "use_sliding_window" in config and not config["use_sliding_window"]:
            types = ["full_attention"] * n  # Qwen2/3: the window is declared but off
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"{where}: layer_types={types} must give 'full_attention' or 'sliding_attention' for each of the "
                         f"{n} layers")
    if "sliding_attention" in types and not window:
        raise ValueError(f"{where}: layer_types has sliding layers but sliding_window={window!r}")
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention=true: only causal decoders are described")
    qkv_bias = {"never": False, "always": True, "config": bool(config.get("attention_bias"))}[fam.qkv_bias]
    scale_base = config.get(fam.attn_scale_key) if fam.attn_scale_key else None
    return Architecture(
        model_type=mt, family=fam.name, hidden_size=hidden, intermediate_size=config["intermediate_size"],
        num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        vocab_size=config["vocab_size"], context_length=int(config.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), norm_offset=fam.norm_offset,
        activation=ACTIVATIONS[act_name], qkv_bias=qkv_bias, o_bias=bool(config.get("attention_bias")) and fam.o_bias,
        mlp_bias=bool(config.get("mlp_bias")), qk_norm=fam.qk_norm, sandwich_norms=fam.sandwich_norms,
        embed_scale=float(np.float32(math.sqrt(hidden))) if fam.embed_scale else 1.0,
        attn_scale=float(scale_base) ** -0.5 if scale_base else float(head_dim) ** -0.5,
        attn_softcap=attn_cap or None, final_softcap=final_cap or None,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", fam.name.startswith("Gemma"))),
        sliding_window=window if "sliding_attention" in types else None, layer_types=tuple(types),
        rope=_ropes(config, fam, where),
    )


# --------------------------------------------------------------------------------------------
# The support matrix
# --------------------------------------------------------------------------------------------

RUNS = "runs"
# Per backend: family model_type -> RUNS, or why it is refused. A family absent from a backend's dict is refused with
# "not implemented by this backend". Cells are what the code does; README marks the GPU backends unverified on GPU.
BACKEND_FAMILIES: dict[str, dict[str, str]] = {
    "cpu_native": {mt: RUNS for mt in FAMILIES},
    "cpu": {"llama": RUNS, "qwen2": RUNS, "qwen3": RUNS,
            "mistral": "onnxruntime-genai's sliding-window GroupQueryAttention fails when scoring a Mistral model built by its "
                       "builder (total_sequence_length must equal past + kv length); use cpu_native",
            "gemma2": "not taken by this backend's converter in edgeflow (its builder's Gemma path is not wired or tested here)",
            "gemma3_text": "onnxruntime-genai's builder fails on Gemma 3 configs (KeyError 'rope_type'); use cpu_native"},
    "llama_cpp": {mt: RUNS for mt in FAMILIES},
    # Per family since which TensorRT-LLM release, and which checkpoints: edgeflow/engines/tensorrt_llm/plan.py CONVERTERS.
    "tensorrt_llm": {"llama": RUNS, "qwen2": RUNS, "qwen3": RUNS, "gemma2": RUNS, "gemma3_text": RUNS,
                     "mistral": "not converted: TensorRT-LLM's sliding-window attention is a runtime setting edgeflow "
                                "does not drive"},
    # Edge-LLM's exporter reads the Hugging Face checkpoint and picks the family itself (docs supported-models.md:
    # Llama 3/3.1/3.2, Qwen2/2.5, Qwen3); edgeflow stages it (edgeflow/engines/edge_llm/staging.py) with every dense
    # tensor, biases and q/k norms included.
    "edge_llm": {"llama": RUNS, "qwen2": RUNS, "qwen3": RUNS,
                 "gemma2": "TensorRT Edge-LLM supports no Gemma 2 (docs: supported-models.md)",
                 "gemma3_text": "TensorRT Edge-LLM supports no Gemma 3 (docs: supported-models.md)",
                 "mistral": "TensorRT Edge-LLM supports no Mistral (docs: supported-models.md)"},
    "vllm": {mt: RUNS for mt in FAMILIES},
}
NOT_IMPLEMENTED = "not implemented by this backend yet"


def backends_for(model_type: str) -> list[str]:
    """The backends that run `model_type`."""
    return [b for b, fams in BACKEND_FAMILIES.items() if fams.get(model_type) == RUNS]


def check_backend(arch: Architecture, backend: str, where: str = "config.json") -> None:
    """ValueError unless `backend` runs `arch`'s family: names the family, the backend, why, and which backends can."""
    verdict = BACKEND_FAMILIES.get(backend, {}).get(arch.model_type, NOT_IMPLEMENTED)
    if verdict == RUNS:
        own_bias = FAMILIES[arch.model_type].qkv_bias == "always"  # Qwen2's q/k/v biases: its converters' own
        if backend in ("tensorrt_llm", "edge_llm") and ((arch.qkv_bias and not own_bias) or arch.o_bias or arch.mlp_bias):
            raise ValueError(f"{where}: {arch.family} with attention_bias/mlp_bias: engine.backend={backend} converts "
                             f"the family's own layers only (q/k/v biases on Qwen2); backends that run it: "
                             f"{_others(arch, backend)}")
        return
    raise ValueError(f"{where}: the {arch.family} family (model_type {arch.model_type!r}) cannot run on "
                     f"engine.backend={backend}: {verdict}; backends that run it: {_others(arch, backend)}")


# GGUF `general.architecture` -> transformers model_type (what a GGUF teacher converts to).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text"}


def require_family(model_type: str | None, backend: str, where: str) -> None:
    """ValueError unless `backend` runs the family `model_type` (family level only: what a profile can check before the
    model's full config.json is on the host)."""
    fam = FAMILIES.get(model_type)
    if fam is None:
        known = ", ".join(f"{k} ({f.name})" for k, f in FAMILIES.items())
        raise ValueError(f"{where}: model_type={model_type!r} is not a supported family (supported: {known}); "
                         "README, 'Model families', lists what each backend runs")
    verdict = BACKEND_FAMILIES.get(backend, {}).get(model_type, NOT_IMPLEMENTED)
    if verdict != RUNS:
        others = ", ".join(b for b in backends_for(model_type) if b != backend) or "none"
        raise ValueError(f"{where}: the {fam.name} family (model_type {model_type!r}) cannot run on "
                         f"engine.backend={backend}: {verdict}; backends that run it: {others}")


def require(config: dict[str, Any], backend: str, where: str = "config.json") -> Architecture:
    """describe + check_backend: what a backend's build (or plan) calls first, before any work."""
    if config.get("model_type") in FAMILIES:  # refused as a family first, whatever else the config says
        require_family(config["model_type"], backend, where)
    arch = describe(config, where)
    check_backend(arch, backend, where)
    return arch


def _others(arch: Architecture, backend: str) -> str:
    return ", ".join(b for b in backends_for(arch.model_type) if b != backend) or "none"


def transformers_kwargs(model_dir) -> dict[str, Any]:
    """What every `from_pretrained` of the model in `model_dir` passes: eager attention when the model softcaps its
    attention logits (Gemma 2), because transformers' sdpa attention, its default, drops `attn_logit_softcapping`
    (on the tests' tiny Gemma 2, logits then differ from the eager model's by up to 1.3). {} otherwise."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    return {"attn_implementation": "eager"} if config.get("attn_logit_softcapping") else {}


# A layer cut that removes less than this share of the teacher's parameters is rarely worth a distillation: the
# Gemma 3 270M demo kept 14 of 18 layers and saved 8 % (245.8 M of 268 M; its 262,144 x 640 embedding, tied with the
# head, is 63 % of the model and no cut removes it). The student is then nearly as slow and large as the teacher, and
# worse (BENCHMARKS.md#student-gate).
MIN_CUT_SAVING = 0.25


def cut_advice(arch: Architecture, kept: int) -> str | None:
    """None when a student of the teacher `arch` with `kept` decoder layers is at least MIN_CUT_SAVING smaller than
    it; else what it saves, why so little, and what saves more (`edgeflow init` and `edgeflow plan` print it)."""
    teacher, student = arch.params(), arch.params(kept)
    saving = 1 - student / teacher
    if saving >= MIN_CUT_SAVING:
        return None
    half_layers = max(1, (arch.num_hidden_layers + 1) // 2)
    half = arch.params(half_layers)
    fewer = (f"fewer layers (every other layer leaves {half / 1e6:.1f} M, {1 - half / teacher:.0%} smaller), "
             if kept > half_layers else "")
    tied = " (tied with the head)" if arch.tie_word_embeddings else " and head"
    return (f"the student keeps {kept} of the teacher's {arch.num_hidden_layers} layers: about {student / 1e6:.1f} M of its "
            f"{teacher / 1e6:.1f} M parameters, {saving:.0%} smaller (under {MIN_CUT_SAVING:.0%}), because the "
            f"{arch.vocab_size:,} x {arch.hidden_size} embedding{tied} is {arch.embedding_params / teacher:.0%} of the model "
            f"and no layer cut removes it. What saves more: {fewer}a narrower student on the same tokenizer "
            "(distill.student_from: its embedding shrinks with its width), or pruning the vocabulary to the tokens "
            "your traffic uses (not done by edgeflow: it costs a remapped tokenizer and head, and a token outside the "
            "kept set can no longer be produced)")
