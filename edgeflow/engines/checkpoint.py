"""The one reader of llm-compressor (compressed-tensors) checkpoints, for every engine backend.

    python -c "from edgeflow.engines.checkpoint import weight_schemes, read_config; print(weight_schemes(read_config('ckpt')))"

What a checkpoint stores, and only that, is read here:

* `read_config` / `weight_schemes`: `config.json`'s `quantization_config` as one typed `WeightScheme` per
  config group, after the checks no engine can honour (another quant_method, quantized KV cache,
  sparsity, transforms, activation quantization, dynamic weights) have raised ValueError naming the field.
* `load_tensors`: every `*.safetensors` tensor as numpy (bfloat16 widened exactly to float32).
* `quantized_layers` / `layer`: per decoder linear, the stored integers as numpy: q (unsigned, as packed:
  signed value + 2**(bits-1)), zero (unsigned, per group; 2**(bits-1) when symmetric) and the fp32
  scale, so that w = (q - zero) * scale exactly. Shapes, group index and layout are checked here.
* `pack_int32_le` / `unpack_int32_le`: the nibble/byte packing compressed-tensors and GPTQ share.
* `load_dequantized`: the checkpoint as a plain float32 transformers model whose weights are exactly
  the dequantized values (the fake-quantized reference the gate and the dequantizing builds use).

What each backend can hold exactly (int4 MatMulNBits blocks, the native kernel's group of 64,
TensorRT-LLM's group sizes) is that backend's own rule, in its own module.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # torch only for load_dequantized
    import torch

# Decoder linear layers of a Llama checkpoint: the ones llm-compressor's recipes quantize.
LINEAR_RE = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$")
# Tensor leaves compressed-tensors writes for one quantized Linear.
QUANT_LEAVES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


class InexactWeights(ValueError):
    """The checkpoint's weights are quantized in a way this engine's kernels cannot hold exactly.

    Backends that can fall back to the exactly dequantized weights (`inexact_weights: dequantize`)
    catch this one; every other ValueError refuses the checkpoint.
    """


class WeightScheme(BaseModel):
    """One config group's weight quantization, as compressed-tensors records it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: int = Field(description="weights.num_bits: 4 (W4A16) or 8 (W8A16) for the shipped recipes.")
    type: str = Field(default="int", description="weights.type: 'int' or 'float'.")
    strategy: str | None = Field(description="weights.strategy: 'group', 'channel' or 'tensor'.")
    group_size: int | None = Field(description="weights.group_size (columns per scale) for strategy 'group', else None.")
    symmetric: bool = Field(description="weights.symmetric: no zero point stored when true.")
    actorder: str | None = Field(default=None, description="weights.actorder: None/'static'/'weight' keep contiguous groups; 'group' permutes them.")
    format: str | None = Field(description="The group's (or the checkpoint's) compression format, e.g. 'pack-quantized'.")

    def summary(self) -> dict[str, Any]:
        """What the CPU engines record in engine.json under "quantization"."""
        return {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric, "format": self.format}


@dataclass(frozen=True)
class QuantizedLayer:
    """One quantized Linear [out, in]: w = (q - zero[:, g]) * scale[:, g] for column c in group g = c // group_size."""

    q: np.ndarray  # uint8 [out, in], unsigned as stored (signed + 2**(bits-1))
    zero: np.ndarray  # uint8 [out, groups], unsigned (2**(bits-1) when symmetric)
    scale: np.ndarray  # float32 [out, groups]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]


def read_config(checkpoint_dir: Path) -> dict[str, Any]:
    """config.json of a Hugging Face checkpoint directory (ValueError if there is none)."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{checkpoint_dir}: no config.json; not a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def weight_schemes(config: dict[str, Any], where: str = "config.json", engine: str = "this") -> dict[str, WeightScheme] | None:
    """None for a dense checkpoint; {config group: WeightScheme} of a compressed-tensors one.

    Raises ValueError (naming `where`'s field) for what no engine builds: another quant_method, a
    quantized KV cache, sparsity, transforms, activation quantization or dynamic weights. `engine`
    names the backend in the messages.
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    where = f"{where} quantization_config"
    method = qc.get("quant_method")
    if method in ("awq", "gptq"):
        raise ValueError(
            f"{where}.quant_method={method!r}: an AutoAWQ/GPTQ checkpoint; import it once, bit-exactly, with "
            "`python -m edgeflow.engines.checkpoint import SRC DST` and build from DST (compressed-tensors)"
        )
    if method != "compressed-tensors":
        raise ValueError(
            f"{where}.quant_method={method!r}: the {engine} engine builds llm-compressor 'compressed-tensors' "
            "checkpoints or dense ones; refusing to guess at another format"
        )
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"{where}.kv_cache_scheme={qc['kv_cache_scheme']!r}: quantized KV cache is not supported")
    if qc.get("sparsity_config"):
        raise ValueError(f"{where}.sparsity_config is set: sparse compressed checkpoints are not supported")
    if qc.get("transform_config"):
        raise ValueError(f"{where}.transform_config is set: rotated (transformed) checkpoints are not supported")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where}.config_groups is empty: cannot tell what the weights are")
    schemes = {}
    for name, group in groups.items():
        g = f"{where}.config_groups.{name}"
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"{g}: activation quantization is set; the {engine} engine builds weight-only schemes (W4A16, W8A16)")
        w = group.get("weights") or {}
        if w.get("dynamic"):
            raise ValueError(f"{g}.weights.dynamic=true: dynamic weight quantization is not supported")
        strategy = w.get("strategy")
        schemes[name] = WeightScheme(
            bits=int(w.get("num_bits") or 0), type=str(w.get("type", "int")), strategy=strategy,
            group_size=w.get("group_size") if strategy == "group" else None, symmetric=bool(w.get("symmetric", True)),
            actorder=w.get("actorder"), format=group.get("format") or qc.get("format"),
        )
    return schemes


def load_tensors(checkpoint_dir: Path) -> dict[str, np.ndarray]:
    """All *.safetensors tensors as numpy (bfloat16 widened exactly to float32)."""
    from safetensors import safe_open

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{checkpoint_dir}: no *.safetensors weights")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="np") as fh:
                for k in fh.keys():
                    tensors[k] = fh.get_tensor(k)
        except Exception:  # bfloat16 has no numpy dtype: read through torch (real I/O errors re-raise there)
            from safetensors.torch import load_file

            for k, t in load_file(str(f)).items():
                tensors[k] = (t.float() if t.is_floating_point() else t).numpy()
    return tensors


def unpack_int32_le(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words packing 32/bits unsigned values along the last dim, value k at bits k*bits (little-endian) -> uint8."""
    per = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    vals = (np.ascontiguousarray(words, dtype=np.int32).view(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(*words.shape[:-1], words.shape[-1] * per).astype(np.uint8)


def pack_int32_le(values: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of unpack_int32_le along the last dim (length a multiple of 32/bits) -> int32."""
    per = 32 // bits
    v = values.astype(np.uint32).reshape(*values.shape[:-1], values.shape[-1] // per, per)
    words = (v << np.arange(0, 32, bits, dtype=np.uint32)).sum(-1, dtype=np.uint64).astype(np.uint32)
    return words.view(np.int32)


def split_tensors(tensors: dict[str, np.ndarray], where: Path) -> tuple[dict[str, np.ndarray], list[str]]:
    """(dense tensors, prefixes of the quantized linears); ValueError for a layout no engine builds.

    Every quantized tensor must belong to a Llama decoder linear, and no decoder linear may be stored
    dense while others are quantized (one precision covers every linear layer).
    """
    dense = {k: v for k, v in tensors.items() if k.rpartition(".")[2] not in QUANT_LEAVES}
    prefixes = sorted({k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")})
    if not prefixes:
        raise ValueError(f"{where}: quantization_config present but no *.weight_packed tensors found")
    for p in prefixes:
        if not LINEAR_RE.match(p):
            raise ValueError(f"{where}: quantized tensor {p} is not a Llama decoder linear layer")
    for k in dense:
        prefix, _, leaf = k.rpartition(".")
        if leaf == "weight" and LINEAR_RE.match(prefix):
            raise ValueError(
                f"{where}: decoder linear {prefix} is stored dense while the others are quantized; one precision "
                "covers every linear layer"
            )
    return dense, prefixes


def layer(tensors: dict[str, np.ndarray], prefix: str, scheme: WeightScheme) -> QuantizedLayer:
    """The stored integers, zero points and scales of one quantized Linear, checked against its shape.

    compressed-tensors pack-quantized, per Linear [out, in]:
      weight_packed     int32 [out, in*bits/32]  value k of word j = q[o, (32/bits)j+k] + 2**(bits-1)
      weight_scale      float [out, groups]
      weight_zero_point int32 [out*bits/32, groups] (asymmetric only), packed along the *output* dim
    InexactWeights for a permuted weight_g_idx (act-order groups); ValueError for inconsistent shapes.
    """
    bits = scheme.bits
    packed = tensors.get(f"{prefix}.weight_packed")
    if packed is None:
        raise ValueError(f"{prefix}: no weight_packed tensor (a mixed dense/quantized decoder is not supported)")
    shape = tensors.get(f"{prefix}.weight_shape")
    n_out, n_in = (int(shape[0]), int(shape[1])) if shape is not None else (packed.shape[0], packed.shape[1] * 32 // bits)
    scale = np.asarray(tensors[f"{prefix}.weight_scale"], dtype=np.float32).reshape(n_out, -1)
    gs = scheme.group_size or n_in
    if packed.shape != (n_out, n_in * bits // 32) or n_in % gs or scale.shape[1] != n_in // gs:
        raise ValueError(f"{prefix}: packed {tuple(packed.shape)} / scale {tuple(scale.shape)} do not match weight "
                         f"[{n_out}, {n_in}] in groups of {gs}")
    g_idx = tensors.get(f"{prefix}.weight_g_idx")
    if g_idx is not None and not np.array_equal(np.asarray(g_idx).astype(np.int64), np.arange(n_in) // gs):
        raise InexactWeights(f"{prefix}: act-order weight_g_idx (non-contiguous groups) is not representable")
    q = unpack_int32_le(packed, bits)[:, :n_in]
    if scheme.symmetric:
        zero = np.full(scale.shape, 1 << (bits - 1), dtype=np.uint8)
    else:
        zp = tensors[f"{prefix}.weight_zero_point"]
        zero = np.ascontiguousarray(unpack_int32_le(np.ascontiguousarray(zp.T), bits)[:, :n_out].T)
    return QuantizedLayer(q=q, zero=zero, scale=scale)


def quantized_layers(tensors: dict[str, np.ndarray], scheme: WeightScheme, where: Path) -> Iterator[tuple[str, QuantizedLayer]]:
    """(prefix, QuantizedLayer) of every quantized decoder linear, in name order."""
    _, prefixes = split_tensors(tensors, where)
    for prefix in prefixes:
        yield prefix, layer(tensors, prefix, scheme)


def load_dequantized(model_dir: Path) -> torch.nn.Module:
    """A compressed-tensors checkpoint as a plain float32 model whose weights are exactly the dequantized values.

    Reloaded as-is, a compressed checkpoint unpacks its integer weights on every forward pass. Loaded
    with run_compressed=False the weights are decompressed once; they are then moved into a plain model:
    the same numbers, without per-call quantization wrappers. A dense checkpoint loads unchanged.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from edgeflow.model.architecture import transformers_kwargs

    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "quantization_config", None) is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **transformers_kwargs(model_dir)).eval()
    q = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False),
        **transformers_kwargs(model_dir),
    )
    del config.quantization_config
    # Built on the meta device and given q's tensors: from_config on the CPU draws every weight at random first
    # (3.5 s a model for the demo's 24-layer student, all of it thrown away).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **transformers_kwargs(model_dir))
    missing, _ = model.load_state_dict(q.state_dict(), strict=False, assign=True)
    if missing:
        raise RuntimeError(f"{model_dir}: decompressed checkpoint lacks {missing[:3]}")
    buffers = dict(q.named_buffers())  # non-persistent buffers (the rotary frequencies) are not in a state dict
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, buffers[name], persistent=False)
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{model_dir}: decompressed checkpoint lacks {left[:3]}")
    return model.eval()



def int4_group_scheme(schemes: dict[str, WeightScheme], where: str, group_sizes: tuple[int, ...], kernel: str) -> WeightScheme:
    """The one int4, group-wise, contiguous-group scheme of a checkpoint, in group sizes `kernel` runs.

    InexactWeights (naming the config group and field) for anything else: another format or bit width,
    per-channel scales, a group size outside `group_sizes`, act-order, or several schemes at once.
    """
    found = set()
    for name, s in schemes.items():
        g = f"{where} quantization_config.config_groups.{name}"
        if s.format != "pack-quantized":
            raise InexactWeights(f"{g}.format={s.format!r}: only 'pack-quantized' int4 weights repack into {kernel}")
        if s.bits != 4 or s.type != "int":
            raise InexactWeights(f"{g}.weights: num_bits={s.bits} type={s.type!r}; {kernel} holds 4-bit int weights only")
        if s.strategy != "group":
            raise InexactWeights(f"{g}.weights.strategy={s.strategy!r}: only 'group' is supported (per-channel/tensor "
                                 f"scales are not {kernel} blocks)")
        if s.group_size not in group_sizes:
            raise InexactWeights(f"{g}.weights.group_size={s.group_size}: {kernel} group sizes are {group_sizes}; "
                                 "this group size is not representable")
        if s.actorder not in (None, "static", "weight"):
            raise InexactWeights(f"{g}.weights.actorder={s.actorder!r}: act-order with a permuted g_idx is not "
                                 f"representable by {kernel} contiguous blocks (use actorder weight or none)")
        found.add(s)
    if len(found) != 1:
        raise InexactWeights(f"{where} quantization_config: config groups use different schemes "
                             f"{sorted(str(s.summary()) for s in found)}; expected one")
    return found.pop()


def gptq_layer(q: QuantizedLayer, bits: int) -> dict[str, np.ndarray]:
    """One layer in AutoGPTQ's layout (what onnxruntime-genai's and TensorRT-LLM's GPTQ loaders read).

      qweight int32 [in*bits/32, out]  packed along the input dim: weight_packed transposed
      qzeros  int32 [groups, out*bits/32] packed along the output dim, storing zero - 1 (the loaders add 1 back;
                                          a zero point of 0 wraps to 2**bits - 1: callers that cannot take it check first)
      scales  float32 [groups, out]
      g_idx   int32 [in] = column // group_size (contiguous groups only: `layer` refuses act-order)
    """
    mask = (1 << bits) - 1
    n_in = q.q.shape[1]
    return {
        "qweight": np.ascontiguousarray(pack_int32_le(q.q, bits).T),
        "qzeros": pack_int32_le(np.ascontiguousarray(((q.zero.astype(np.int16) - 1) & mask).astype(np.uint8).T), bits),
        "scales": np.ascontiguousarray(q.scale.T, dtype=np.float32),
        "g_idx": (np.arange(n_in) // q.group_size).astype(np.int32),
    }


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer/chat files a checkpoint has next to its weights; returns the names copied."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def write_gptq_int4(checkpoint_dir: Path, out_dir: Path, scheme: WeightScheme, dense_dtype: Any = None) -> dict[str, int]:
    """Rewrite an int4 pack-quantized checkpoint in AutoGPTQ's layout, bit-exactly (nothing re-quantized).

    Dense tensors are kept (cast to `dense_dtype` when given: a loader that computes in float16 and refuses to mix,
    as Edge-LLM's does); every decoder linear becomes qweight/qzeros/scales/g_idx (`gptq_layer`), and
    config.json's quantization_config says gptq (bits 4, the scheme's group size, desc_act false). Scales
    must be finite and positive: the loaders divide by them when they re-derive the integers. Returns
    counts of what was written.
    """
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_tensors(checkpoint_dir)
    dense, prefixes = split_tensors(tensors, Path(checkpoint_dir))
    out: dict[str, np.ndarray] = {k: (v.astype(dense_dtype) if dense_dtype is not None and np.issubdtype(v.dtype, np.floating)
                                      else v) for k, v in dense.items()}
    for prefix in prefixes:
        q = layer(tensors, prefix, scheme)
        n_out, n_in = q.q.shape
        if n_in % 8 or n_out % 8:
            raise ValueError(f"{prefix}: weight [{n_out}, {n_in}] is not a whole number of 8-nibble words")
        if not (np.isfinite(q.scale).all() and (q.scale > 0).all()):
            raise ValueError(f"{prefix}: weight_scale has zero, negative or non-finite entries")
        out.update({f"{prefix}.{k}": v for k, v in gptq_layer(q, 4).items()})
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = read_config(checkpoint_dir)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": scheme.group_size,
                                     "sym": scheme.symmetric, "desc_act": False, "checkpoint_format": "gptq"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer_files(checkpoint_dir, out_dir)
    return {"linear_layers": len(prefixes), "tensors": len(out)}


# --------------------------------------------------------------------------------------------
# Pre-quantized checkpoints: AutoAWQ (GEMM) and GPTQ (AutoGPTQ / GPTQModel), imported once as compressed-tensors
# --------------------------------------------------------------------------------------------

# AutoAWQ's GEMM layout packs 8 output columns per int32 in this order (nibble i holds column 8c + AWQ_ORDER[i]).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def prequantized(config: dict[str, Any]) -> str | None:
    """'awq' or 'gptq' for an AutoAWQ / AutoGPTQ / GPTQModel checkpoint (import_prequantized reads it), else None."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    return method if method in ("awq", "gptq") else None


def _prequantized_layer(tensors: dict[str, np.ndarray], prefix: str, qc: dict[str, Any], where: str
                        ) -> tuple[QuantizedLayer, np.ndarray | None]:
    """(the layer's integers, zero points and scales as `layer` gives them; its g_idx when the groups are permuted)."""
    method, bits = qc["quant_method"], int(qc.get("bits") or qc.get("w_bit") or 0)
    qweight, qzeros = tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"]
    scales = np.asarray(tensors[f"{prefix}.scales"], dtype=np.float32)  # fp16 widened exactly
    if method == "awq":  # qweight [in, out/8], qzeros [groups, out/8], scales [groups, out]
        inv = np.argsort(AWQ_ORDER)

        def cols(words: np.ndarray) -> np.ndarray:  # unpack along outputs, undoing AWQ's interleave
            v = unpack_int32_le(words, 4).reshape(words.shape[0], -1, 8)
            return v[:, :, inv].reshape(words.shape[0], -1)

        q, zero, g_idx = cols(qweight).T, cols(qzeros).T, None
    else:  # gptq: qweight [in*bits/32, out] packed along inputs, qzeros [groups, out*bits/32], scales [groups, out]
        q = unpack_int32_le(np.ascontiguousarray(qweight.T), bits)
        stored = unpack_int32_le(qzeros, bits).T.astype(np.int16)
        v2 = qc.get("checkpoint_format") == "gptq_v2"  # GPTQModel's v2 stores the zero point; v1 stores zero - 1
        zero = (stored if v2 else (stored + 1) & ((1 << bits) - 1)).astype(np.uint8)
        g = tensors.get(f"{prefix}.g_idx")
        n_in = q.shape[1]
        gs = int(qc.get("group_size") or n_in) if int(qc.get("group_size") or -1) > 0 else n_in
        g_idx = None if g is None or np.array_equal(np.asarray(g).astype(np.int64), np.arange(n_in) // gs) else np.asarray(g, np.int32)
    scale = np.ascontiguousarray(scales.T)
    if not (q.shape[0] == scale.shape[0] == zero.shape[0] and zero.shape[1] == scale.shape[1]):
        raise ValueError(f"{where}: {prefix}: qweight {qweight.shape} / qzeros {qzeros.shape} / scales {scales.shape} "
                         f"do not describe one {method} layer")
    return QuantizedLayer(q=np.ascontiguousarray(q), zero=np.ascontiguousarray(zero), scale=scale), g_idx


def import_prequantized(src: Path, dst: Path) -> WeightScheme:
    """Rewrite an AutoAWQ (GEMM, 4-bit) or GPTQ (AutoGPTQ v1 / GPTQModel v2, 4- or 8-bit, with or without act-order)
    checkpoint as llm-compressor's compressed-tensors pack-quantized format, bit-exactly: the same integers, zero
    points and fp16 scales (widened to fp32). Every backend and the gate then read it through this module, as any
    checkpoint this pipeline quantized. Returns the source's scheme.

    Act-order (desc_act) puts columns in groups by g_idx, not by position; compressed-tensors 0.19 has no form for
    that any more (actorder 'group' was removed), so such a checkpoint is written dense: each weight is
    (q - zero[g_idx]) * scale[g_idx], exact in fp32, and config.json's `edgeflow_imported_from` says what it was.

        python -m edgeflow.engines.checkpoint import Qwen2.5-0.5B-Instruct-AWQ imported/
    """
    src, dst = Path(src), Path(dst)
    config = read_config(src)
    where = f"{src}/config.json quantization_config"
    qc = dict(config.get("quantization_config") or {})
    method = prequantized(config)
    if method is None:
        raise ValueError(f"{where}.quant_method={qc.get('quant_method')!r}: not an AutoAWQ or GPTQ checkpoint")
    bits = int(qc.get("bits") or qc.get("w_bit") or 0)
    if method == "awq" and (str(qc.get("version", "gemm")).lower() != "gemm" or bits != 4 or qc.get("zero_point") is False):
        raise ValueError(f"{where}: version={qc.get('version')!r} bits={bits} zero_point={qc.get('zero_point')!r}: only AutoAWQ's "
                         "GEMM layout (4-bit, with zero points) is read; re-export it as GEMM")
    if method == "gptq" and bits not in (4, 8):
        raise ValueError(f"{where}.bits={bits}: GPTQ checkpoints of 4 or 8 bits are read")
    tensors = load_tensors(src)
    prefixes = sorted({k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")})
    if not prefixes:
        raise ValueError(f"{src}: quant_method {method!r} but no *.qweight tensors")
    bad = [p for p in prefixes if not LINEAR_RE.match(p)]
    if bad:
        raise ValueError(f"{src}: quantized tensor {bad[0]} is not a decoder linear layer")
    out = {k: v for k, v in tensors.items() if k.rpartition(".")[2] not in ("qweight", "qzeros", "scales", "g_idx")}
    group_sizes, act_order, symmetric = set(), False, True
    for prefix in prefixes:
        q, g_idx = _prequantized_layer(tensors, prefix, qc, where)
        n_out, n_in = q.q.shape
        group_sizes.add(n_in // q.scale.shape[1])
        symmetric &= bool((q.zero == 1 << (bits - 1)).all())
        act_order |= g_idx is not None
        out[f"{prefix}.weight_packed"] = pack_int32_le(q.q, bits)
        out[f"{prefix}.weight_scale"] = q.scale
        out[f"{prefix}.weight_shape"] = np.asarray([n_out, n_in], dtype=np.int64)
        out[f"{prefix}.weight_zero_point"] = np.ascontiguousarray(pack_int32_le(np.ascontiguousarray(q.zero.T), bits).T)
        out[f"{prefix}.zero"] = q.zero  # dropped below when every layer turns out symmetric
    if len(group_sizes) != 1:
        raise ValueError(f"{src}: layers use group sizes {sorted(group_sizes)}; one group size is expected")
    gs = group_sizes.pop()
    source = {"quant_method": method, **{k: qc[k] for k in sorted(qc) if k != "quant_method"}}
    if act_order:
        for prefix in prefixes:
            q, g_idx = _prequantized_layer(tensors, prefix, qc, where)
            g = np.arange(q.q.shape[1]) // gs if g_idx is None else g_idx
            w = (q.q.astype(np.float32) - q.zero[:, g].astype(np.float32)) * q.scale[:, g]  # exact: |q - z| < 2**bits
            for leaf in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx", "zero"):
                out.pop(f"{prefix}.{leaf}", None)
            out[f"{prefix}.weight"] = w
        del config["quantization_config"]
        config["edgeflow_imported_from"] = source | {"written": "dense: act-order groups have no compressed-tensors form"}
        _save_imported(src, dst, out, config)
        return WeightScheme(bits=bits, type="int", strategy="group", group_size=gs, symmetric=symmetric, actorder="group",
                            format=method)
    for prefix in prefixes:
        del out[f"{prefix}.zero"]
        if symmetric:  # compressed-tensors stores no zero point for a symmetric scheme (2**(bits-1) implied)
            del out[f"{prefix}.weight_zero_point"]
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": gs,
               "actorder": "group" if act_order else None, "dynamic": False, "observer": "minmax", "observer_kwargs": {},
               "block_structure": None, "scale_dtype": None, "zp_dtype": None if symmetric else "torch.int8"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
        "global_compression_ratio": None,
    }
    config["edgeflow_imported_from"] = source
    _save_imported(src, dst, out, config)
    return next(iter(weight_schemes(config, f"{dst}/config.json").values()))


def _save_imported(src: Path, dst: Path, tensors: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    from safetensors.numpy import save_file

    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer_files(src, dst)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "import":
        raise SystemExit("usage: python -m edgeflow.engines.checkpoint import SRC_DIR DST_DIR")
    print(import_prequantized(Path(sys.argv[2]), Path(sys.argv[3])).summary())


def layer_scheme(tensors: dict[str, np.ndarray], prefix: str, schemes: dict[str, WeightScheme]) -> WeightScheme:
    """The config group's scheme that a layer's stored shapes say it was quantized with (mixed W8/W4 recipes have
    several); InexactWeights when the shapes match none or more than one."""
    packed, scale = tensors[f"{prefix}.weight_packed"], tensors[f"{prefix}.weight_scale"]
    shape = tensors.get(f"{prefix}.weight_shape")
    n_in = int(shape[1]) if shape is not None else None
    found = set()
    for s in schemes.values():
        cols = n_in if n_in is not None else packed.shape[1] * 32 // s.bits
        groups = 1 if s.strategy == "channel" else cols // (s.group_size or cols)
        if packed.shape[1] * 32 == cols * s.bits and scale.reshape(packed.shape[0], -1).shape[1] == groups:
            found.add(s)
    if len(found) != 1:
        raise InexactWeights(f"{prefix}: its stored shapes match {len(found)} of the checkpoint's schemes "
                             f"{sorted(str(s.summary()) for s in schemes.values())}; cannot tell which one it used")
    return found.pop()


def recipe_algorithm(checkpoint_dir: Path) -> str | None:
    """awq/gptq/rtn from the recipe.yaml llm-compressor saves next to the weights (None if absent or unclear; an
    adopted pre-quantized checkpoint has none)."""
    path = Path(checkpoint_dir) / "recipe.yaml"
    if not path.exists():
        return None
    text = path.read_text()
    for marker, name in (("AWQModifier", "awq"), ("GPTQModifier", "gptq"), ("QuantizationModifier", "rtn")):
        if marker in text:
            return name
    return None


def holds_packed_weights(tensor_names) -> bool:
    """Whether a checkpoint's tensor names (e.g. from its safetensors headers) include compressed-tensors' packed
    integers: what a checkpoint whose config.json has a quantization_config must hold."""
    return any(str(k).endswith(".weight_packed") for k in tensor_names)


def checkpoint_algorithm(checkpoint_dir: Path, given: str | None) -> tuple[str | None, str | None]:
    """(the algorithm that produced a checkpoint, where that was read): the engine profile's `algorithm` when given
    ("profile"), else the checkpoint's recipe.yaml ("recipe.yaml"), else (None, None). ValueError when both are known
    and disagree."""
    recipe = recipe_algorithm(checkpoint_dir)
    if given is None:
        return recipe, ("recipe.yaml" if recipe else None)
    if recipe is not None and recipe != given:
        raise ValueError(f"profile algorithm={given!r} but {checkpoint_dir}/recipe.yaml describes {recipe!r}; pass the "
                         "recipe that produced this checkpoint (or drop algorithm to use recipe.yaml)")
    return given, "profile"
