"""The build: an llm-compressor checkpoint (or its dense weights) into engine.json and weights.safetensors.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.model.architecture import Architecture, check_backend, describe
from edgeflow.tracking.artifacts import sha256_tree
from edgeflow.engines import engine_dir as edir, validate_profile
from edgeflow.engines.checkpoint import (InexactWeights, WeightScheme, copy_tokenizer_files, layer, layer_scheme,
    load_dequantized, load_tensors, read_config, weight_schemes)
from edgeflow.engines.cpu_host import device_fingerprint
from edgeflow.engines.sampling import PARAMETERS, REJECTION_TRIES

from edgeflow.engines.cpu_native.kernels import compile_kernels, kernel_sha256
from edgeflow.engines.cpu_native.layout import int8_head, pack_int4, pack_int8
from edgeflow.engines.cpu_native.settings import (BACKEND, FIX, FORMAT_VERSION, GROUP, REQUIRED_ISA, WEIGHTS, _FUSED,
    _LINEARS)


def _arch(config: dict[str, Any], where: Path) -> Architecture:
    """The model's description (edgeflow/model/architecture.py), with this kernel's shape rules; ValueError naming the field."""
    arch = describe(config, f"{where}/config.json")
    check_backend(arch, BACKEND, f"{where}/config.json")
    if arch.mlp_bias:
        raise ValueError(f"{where}/config.json: mlp_bias=true: the cpu_native engine has no MLP biases; {FIX}")
    hd, heads, kv = arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    if hd % 16:
        raise ValueError(f"{where}/config.json: head_dim={hd} must be a multiple of 16 (the attention kernel's width)")
    if arch.hidden_size % 8 or arch.intermediate_size % 8:
        raise ValueError(f"{where}/config.json: hidden_size={arch.hidden_size}, intermediate_size={arch.intermediate_size} "
                         "must be multiples of 8")
    return arch


def _norms_and_biases(dense: dict[str, np.ndarray], arch: Architecture, i: int) -> dict[str, np.ndarray]:
    """Layer i's norm weights (offset folded: Gemma's 1 + w, in fp32 as transformers adds it) and biases, by layer_t name."""
    p = f"model.layers.{i}."
    off = np.float32(arch.norm_offset)

    def norm(name: str) -> np.ndarray:
        return (dense[p + name + ".weight"].astype(np.float32) + off).astype(np.float32)

    out = {"ln1": norm("input_layernorm")}
    if arch.sandwich_norms:
        out |= {"ln2": norm("pre_feedforward_layernorm"), "post_attn": norm("post_attention_layernorm"),
                "post_ffn": norm("post_feedforward_layernorm")}
    else:
        out["ln2"] = norm("post_attention_layernorm")
    if arch.qk_norm:
        out |= {"q_norm": norm("self_attn.q_norm"), "k_norm": norm("self_attn.k_norm")}
    if arch.qkv_bias:
        out["qkv_b"] = np.concatenate([dense[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]).astype(np.float32)
    if arch.o_bias:
        out["o_b"] = dense[f"{p}self_attn.o_proj.bias"].astype(np.float32)
    return out


def native_schemes(schemes: dict[str, WeightScheme], where: str) -> dict[str, WeightScheme]:
    """The checkpoint's config groups, if the kernels run every one exactly: pack-quantized integers of 4 or 8 bits,
    per channel or in groups of a multiple of 64 columns (repeated into 64-column groups at build), contiguous groups.
    InexactWeights naming the config group and field otherwise."""
    for name, sc in schemes.items():
        g = f"{where} quantization_config.config_groups.{name}"
        if sc.format != "pack-quantized":
            raise InexactWeights(f"{g}.format={sc.format!r}: only 'pack-quantized' integers repack into the cpu_native kernels")
        if sc.bits not in (4, 8) or sc.type != "int":
            raise InexactWeights(f"{g}.weights: num_bits={sc.bits} type={sc.type!r}; cpu_native runs 4- and 8-bit int weights")
        if sc.strategy not in ("group", "channel") or (sc.strategy == "group" and (sc.group_size or 0) % GROUP):
            raise InexactWeights(f"{g}.weights: strategy={sc.strategy!r} group_size={sc.group_size}; cpu_native runs "
                                 f"per-channel scales or groups of a multiple of {GROUP} columns; this one is not representable")
        if sc.actorder not in (None, "static", "weight"):
            raise InexactWeights(f"{g}.weights.actorder={sc.actorder!r}: act-order with a permuted g_idx is not "
                                 "representable by cpu_native's contiguous groups (use actorder weight or none)")
    return schemes


def _quantized_linear(tensors: dict[str, np.ndarray], prefix: str, schemes: dict[str, WeightScheme]) -> tuple[int, np.ndarray, ...]:
    """(bits, q uint8 [out, in], s fp32 [out, in/64], z uint8 [out, in/64]) of one linear layer as the checkpoint
    stores it (edgeflow.engines.checkpoint.layer: q - z is exact), its scales and zero points repeated to every 64-column
    group, with the kernels' shape rule: whole 64-column groups and 8-row words."""
    try:
        scheme = layer_scheme(tensors, prefix, schemes) if len(schemes) > 1 else next(iter(schemes.values()))
        q = layer(tensors, prefix, scheme)
    except InexactWeights:
        raise
    except ValueError as e:
        raise ValueError(f"{e}; {FIX}") from e
    n_out, n_in = q.q.shape
    if n_in % GROUP or n_out % 8:
        raise ValueError(f"{prefix}: weight [{n_out}, {n_in}] is not whole {GROUP}-column groups / 8-row words")
    rep = q.group_size // GROUP
    return scheme.bits, q.q, np.repeat(q.scale, rep, axis=1), np.repeat(q.zero, rep, axis=1)


def _dense_weights(checkpoint_dir: Path, dequantize: bool) -> dict[str, np.ndarray]:
    """fp32 state dict as numpy: the checkpoint's tensors, or its exactly dequantized weights."""
    if dequantize:
        return {k: v.detach().float().contiguous().numpy() for k, v in load_dequantized(checkpoint_dir).state_dict().items()}
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in load_tensors(checkpoint_dir).items()}


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """Write the native engine: packed int4 (or fp32) layers, fp32 tables, int8 head, engine.json."""
    from safetensors.numpy import save_file

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    prof = validate_profile(BACKEND, profile)
    config = read_config(checkpoint_dir)
    arch = _arch(config, checkpoint_dir)
    lib_path, kernel = compile_kernels()  # fail early on a machine that cannot run the engine

    dequantized: str | None = None
    try:
        schemes = detect_schemes(checkpoint_dir)
    except InexactWeights as e:
        if prof.inexact_weights == "error":
            raise ValueError(f"{checkpoint_dir}: {e}; cpu_native runs 4- and 8-bit weights in 64-column groups exactly; "
                             f"{FIX}, or profile inexact_weights: dequantize") from e
        schemes, dequantized = None, str(e)

    out: dict[str, np.ndarray] = {}
    bits_used: set[int] = set()
    if schemes is not None:
        tensors = load_tensors(checkpoint_dir)
        if any(k.startswith("lm_head.weight_") for k in tensors):
            raise ValueError(f"{checkpoint_dir}: the lm_head is quantized; cpu_native runs an fp32 lm_head only; {FIX}")
        try:
            for i in range(arch.num_hidden_layers):
                parts = {n: _quantized_linear(tensors, f"model.layers.{i}.{n}", schemes) for n in _LINEARS}
                for fused, names in _FUSED:
                    bits = {parts[n][0] for n in names}
                    if len(bits) != 1:
                        raise InexactWeights(f"layer {i}: {', '.join(names)} mix {sorted(bits)}-bit weights; cpu_native "
                                             "runs them as one fused matrix of one width")
                    q, sc, z = (np.concatenate([parts[n][j] for n in names]) for j in (1, 2, 3))
                    w, si, zi = (pack_int4 if bits == {4} else pack_int8)(q, sc, z)
                    out[f"layers.{i}.{fused}.w"], out[f"layers.{i}.{fused}.s"], out[f"layers.{i}.{fused}.z"] = w, si, zi
                    bits_used |= bits
        except InexactWeights as e:  # found in the tensors (act-order g_idx, mixed widths in a fused matrix)
            if prof.inexact_weights == "error":
                raise ValueError(f"{checkpoint_dir}: {e}; {FIX}, or profile inexact_weights: dequantize") from e
            schemes, dequantized, out, bits_used = None, str(e), {}, set()
        else:
            dense = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()
                     if not k.rpartition(".")[2].startswith("weight_")}
    if schemes is None:
        dense = _dense_weights(checkpoint_dir, dequantize=dequantized is not None)
        for i in range(arch.num_hidden_layers):
            for fused, names in _FUSED:
                w = np.concatenate([dense[f"model.layers.{i}.{n}.weight"] for n in names])
                if w.shape[0] % 4 or w.shape[1] % 8:
                    raise ValueError(f"layer {i} {fused}: weight {w.shape} needs out % 4 == 0 and in % 8 == 0")
                out[f"layers.{i}.{fused}.w"] = np.ascontiguousarray(w, np.float32)
    for i in range(arch.num_hidden_layers):
        out |= {f"layers.{i}.{k}": v for k, v in _norms_and_biases(dense, arch, i).items()}
    out["norm"] = (dense["model.norm.weight"].astype(np.float32) + np.float32(arch.norm_offset)).astype(np.float32)
    embed = dense["model.embed_tokens.weight"]
    out["embed"] = embed
    head = embed if arch.tie_word_embeddings or "lm_head.weight" not in dense else dense["lm_head.weight"]
    if head is not embed:
        out["head.fp32"] = head
    if head.shape[1] % 8:
        raise ValueError(f"lm_head width {head.shape[1]} must be a multiple of 8")
    out.update(int8_head(head))
    out = {k: np.ascontiguousarray(v) for k, v in out.items()}

    out_dir.mkdir(parents=True, exist_ok=True)
    edir.clear_meta(out_dir)
    save_file(out, str(out_dir / WEIGHTS))
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    return edir.write_meta(out_dir, edir.EngineMeta(
        backend=BACKEND,
        format=f"cpu_native weights v{FORMAT_VERSION}",
        precision="+".join(f"int{b}" for b in sorted(bits_used)) or "fp32",  # what the layers compute with (report column)
        checkpoint_sha256=sha256_tree(checkpoint_dir),
        dequantized=dequantized and {"reason": dequantized, "checkpoint_quantization": config["quantization_config"]},
        files=[WEIGHTS],
        tokenizer_files=copied,
        build_identity=build_identity(),
        format_version=FORMAT_VERSION,
        **kernel,
        numpy=np.__version__,
        required_isa=list(REQUIRED_ISA),
        weights="+".join(f"int{b}" for b in sorted(bits_used)) + "-g64" if bits_used else "fp32",
        # what the int4/int8 and head kernels multiply the weights with (fp32 weights take fp32 activations)
        activations="int16 per 64-group" if bits_used else "fp32",
        quantization=_summary(schemes) if schemes else None,
        lm_head={"exact_argmax": "int8 per-row bound + fp32 rescoring", "score": "fp32",
                 "tied": head is embed, "vocab_size": int(head.shape[0])},
        sampling={"method": "exact: the distribution of the fp32 logits (rejection sampling against the int8 per-row "
                            "upper bounds, each proposal rescored in fp32; top_k among the rescored rows that can hold it; "
                            "top_p membership decided by the bounds and rescored rows); the full fp32 head for logprobs "
                            "and whenever a step would rescore more than max_candidates rows",
                  "rejection_tries": REJECTION_TRIES, "parameters": list(PARAMETERS)},
        architecture=arch.summary(),
        profile=prof.model_dump(),
        checkpoint=str(checkpoint_dir.resolve()),
        device=device_fingerprint(),
    ))


def detect_schemes(checkpoint_dir: Path) -> dict[str, WeightScheme] | None:
    """None for a dense checkpoint; its config groups if the kernels run each exactly (native_schemes).

    InexactWeights for other weight-only schemes; ValueError naming the field for anything no engine builds.
    """
    where = f"{checkpoint_dir}/config.json"
    schemes = weight_schemes(read_config(checkpoint_dir), where, engine="cpu_native")
    return None if schemes is None else native_schemes(schemes, where)


def _summary(schemes: dict[str, WeightScheme]) -> dict[str, Any]:
    """engine.json "quantization": the one scheme's summary, or each config group's for a mixed recipe."""
    if len(set(schemes.values())) == 1:
        return next(iter(schemes.values())).summary()
    return {name: sc.summary() for name, sc in schemes.items()}


def build_identity() -> str:
    """What decides whether an engine built earlier still loads here: its format and the kernel source."""
    return f"{BACKEND} format {FORMAT_VERSION}, kernel source {kernel_sha256()[:16]}"
