"""The build: a GGUF file written from an llm-compressor checkpoint's integers (the vocabulary, the tensors, the
metadata llama.cpp reads), and engine.json beside it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.model.architecture import Architecture, Rope, require
from edgeflow.tracking.artifacts import sha256_tree
from edgeflow.engines import engine_dir as edir, validate_profile
from edgeflow.engines.checkpoint import (QUANT_LEAVES, InexactWeights, QuantizedLayer, copy_tokenizer_files, layer,
    layer_scheme, load_dequantized, load_tensors, read_config, split_tensors)
from edgeflow.engines.cpu_host import device_fingerprint
from edgeflow.engines.sampling import PARAMETERS

from edgeflow.engines.llama_cpp.blocks import _rope_heads, detect_schemes, encode_blocks, permute_rope_rows
from edgeflow.engines.llama_cpp.settings import (BACKEND, FORMAT, GGUF_ARCH, GGUF_FILE, GGUF_ROPES, Profile, WRITER,
    _gguf_name, llama_cpp_attn_scale)


def _check_architecture(config: dict[str, Any], where: str) -> Architecture:
    """The model's Architecture, or a ValueError naming the field, its value and the backends that run it, for what
    the GGUF written here cannot express (edgeflow/model/architecture.py's matrix, then what each GGUF architecture's llama.cpp
    graph computes: its RoPE kinds, a sliding window only where the graph has one, q/k/v biases only)."""
    arch = require(config, BACKEND, where)
    g = GGUF_ARCH[arch.model_type]
    for kind, r in arch.rope.items():
        if r.type not in GGUF_ROPES[g] or (g == "gemma3" and kind == "sliding_attention" and r.type != "default"):
            raise ValueError(f"{where}: {arch.family} with rope_type {r.type!r} on its {kind} layers: llama.cpp's {g!r} "
                             f"graph applies {sorted(GGUF_ROPES[g])}; use engine.backend=cpu_native")
    if arch.sliding_window is not None and not g.startswith("gemma") and arch.sliding_window < arch.context_length:
        raise ValueError(f"{where}: {arch.family} with sliding_window={arch.sliding_window} (shorter than "
                         f"max_position_embeddings={arch.context_length}): llama.cpp's {g!r} graph has no sliding window; "
                         "use engine.backend=cpu_native")
    if g == "gemma2" and not arch.tie_word_embeddings:
        raise ValueError(f"{where}: Gemma 2 with tie_word_embeddings=false: llama.cpp's 'gemma2' graph always reads its "
                         "head from the token embedding; use engine.backend=cpu_native")
    if arch.o_bias or arch.mlp_bias:
        raise ValueError(f"{where}: {arch.family} with an o_proj or MLP bias: the GGUF written here carries q/k/v biases "
                         "only; use engine.backend=cpu_native")
    return arch


def _vocab(checkpoint_dir: Path, n_vocab: int, where: str) -> tuple[list[str], list[int]]:
    """(tokens by id, token types) from tokenizer.json, padded to the model's vocabulary as llama.cpp's converter does."""
    from gguf import TokenType

    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{checkpoint_dir}: no tokenizer.json; the llama_cpp backend needs a fast (BPE) tokenizer file")
    data = json.loads(path.read_text())
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{path} model.type={model.get('type')!r}: the llama_cpp backend writes BPE (gpt2-style) "
                         "tokenizers only")
    by_id = {int(i): t for t, i in model.get("vocab", {}).items()}
    kinds: dict[int, int] = {}
    for added in data.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
        kinds[int(added["id"])] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    if max(by_id, default=-1) >= n_vocab:
        raise ValueError(f"{where}: tokenizer ids reach {max(by_id)} but vocab_size is {n_vocab}")
    tokens, types = [], []
    for i in range(n_vocab):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(int(kinds.get(i, TokenType.NORMAL)))
        else:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
    return tokens, types


def _dense(x: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    """A dense tensor as written: f32 / f16 data, or q8_0 bytes (gguf.quants), with its raw dtype (None: from the array)."""
    from gguf import GGMLQuantizationType, quants

    if kind == "f32":
        return np.ascontiguousarray(x, dtype=np.float32), None
    if kind == "f16":
        return np.ascontiguousarray(x, dtype=np.float16), None
    return quants.quantize(np.ascontiguousarray(x, dtype=np.float32), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


def write_gguf(checkpoint_dir: Path, out: Path, prof: Profile, dequantized_from: Any = None) -> dict[str, Any]:
    """Write the checkpoint as one llama.cpp GGUF file; returns what was written (types, rounding).

    `dequantized_from`: a dense float32 state dict to use instead of the checkpoint's tensors (a quantized
    checkpoint built dense from its exactly dequantized weights).
    """
    from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFWriter, RopeScalingType, SpecialVocab

    checkpoint_dir = Path(checkpoint_dir)
    where = f"{checkpoint_dir}/config.json"
    config = read_config(checkpoint_dir)
    arch = _check_architecture(config, where)
    g = GGUF_ARCH[arch.model_type]
    schemes = None if dequantized_from is not None else detect_schemes(checkpoint_dir)
    if dequantized_from is not None:
        tensors, prefixes = dequantized_from, []
    else:
        tensors = load_tensors(checkpoint_dir)
        prefixes = split_tensors(tensors, checkpoint_dir)[1] if schemes else []
    n_vocab, heads, head_dim = arch.vocab_size, arch.num_attention_heads, arch.head_dim
    n_layers = arch.num_hidden_layers
    full = arch.rope.get("full_attention") or next(iter(arch.rope.values()))

    w = GGUFWriter(str(out), g)
    w.add_name(str(config.get("_name_or_path") or checkpoint_dir.name) or "edgeflow")
    w.add_context_length(arch.context_length)
    w.add_embedding_length(arch.hidden_size)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(arch.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    if head_dim != arch.hidden_size // heads or g.startswith("gemma"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(full.theta)
    if full.type == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full.factor))
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    if g.startswith("gemma"):  # always the per-layer list: llama.cpp's own default pattern (2 or 6) is not the model's
        w.add_sliding_window_pattern([t == "sliding_attention" for t in arch.layer_types])
        if arch.sliding_window is not None:
            w.add_sliding_window(arch.sliding_window)
            w.add_rope_freq_base_swa((arch.rope.get("sliding_attention") or full).theta)
    if arch.attn_softcap:
        w.add_attn_logit_softcapping(arch.attn_softcap)
    if arch.final_softcap:
        w.add_final_logit_softcapping(arch.final_softcap)
    w.add_vocab_size(n_vocab)
    w.add_quantization_version(2)
    tokens, types = _vocab(checkpoint_dir, n_vocab, where)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    SpecialVocab(checkpoint_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(w, quiet=True)

    types_written: dict[str, int] = {}
    rounding: dict[str, dict[str, float]] = {}
    # Fixed once here, not per token: Gemma's (1 + w) norms become w' = 1 + w, and where llama.cpp's graph scales the
    # queries other than the model does (query_pre_attn_scalar), the ratio is folded into the queries: into q_norm
    # (Gemma 3: RMSNorm output times w') or into q_proj's rows (Gemma 2, whose queries go straight to RoPE, a linear map).
    q_fold = arch.attn_scale / llama_cpp_attn_scale(arch, g)
    q_fold = 1.0 if abs(q_fold - 1.0) < 1e-12 else q_fold

    def add(hf_name: str, data: np.ndarray, raw_dtype: Any, kind: str) -> None:
        w.add_tensor(_gguf_name(hf_name, g, n_layers), data, raw_dtype=raw_dtype)
        types_written[kind] = types_written.get(kind, 0) + 1

    if full.type == "llama3":  # per-dimension divisors of the default frequencies (llama.cpp's rope_freqs)
        default = Rope(type="default", theta=full.theta).inv_freq(head_dim)
        w.add_tensor(TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight", (default / full.inv_freq(head_dim)).astype(np.float32))
        types_written["f32"] = types_written.get("f32", 0) + 1

    quant_prefixes = set(prefixes)
    for prefix in sorted(quant_prefixes):
        folds_q = q_fold != 1.0 and not arch.qk_norm and prefix.endswith("self_attn.q_proj")
        s = layer_scheme(tensors, prefix, schemes)
        q = layer(tensors, prefix, s)
        if folds_q:
            q = QuantizedLayer(q.q, q.zero, (q.scale * np.float32(q_fold)).astype(q.scale.dtype))
        if (n := _rope_heads(prefix, config)) is not None:
            q = QuantizedLayer(permute_rope_rows(q.q, n), permute_rope_rows(q.zero, n), permute_rope_rows(q.scale, n))
        kind, blocks, r = encode_blocks(q, s.bits, s.symmetric)
        add(f"{prefix}.weight", blocks, getattr(GGMLQuantizationType, kind), kind)
        agg = rounding.setdefault(kind, {"scale_rel": 0.0, "m_rel": 0.0, "weight_abs": 0.0})
        for k, v in r.items():
            agg[k] = max(agg[k], v)
    for name in sorted(tensors):
        prefix, _, leaf = name.rpartition(".")
        if prefix in quant_prefixes and leaf in QUANT_LEAVES:
            continue  # written above from its integers; a quantized layer's bias is written dense, below
        folds_q = q_fold != 1.0 and ((arch.qk_norm and prefix.endswith("self_attn.q_norm"))
                                     or (not arch.qk_norm and prefix.endswith("self_attn.q_proj")))
        x = np.asarray(tensors[name].detach().numpy() if hasattr(tensors[name], "detach") else tensors[name])
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue  # llama.cpp reads a tied head from token_embd
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            data, raw = _dense(x, prof.head)
            add(name, data, raw, prof.head)
            continue
        if name.endswith("norm.weight") and arch.norm_offset:
            x = x.astype(np.float32) + np.float32(arch.norm_offset)
        if folds_q:
            x = x.astype(np.float32) * np.float32(q_fold)
        if (n := _rope_heads(prefix, config)) is not None:
            x = permute_rope_rows(x, n)  # weights and biases alike: rows
        if x.ndim == 1:  # norms and biases: llama.cpp computes them in f32
            add(name, np.ascontiguousarray(x, dtype=np.float32), None, "f32")
        else:
            data, raw = _dense(x, prof.dense)
            add(name, data, raw, prof.dense)
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{checkpoint_dir}: no model.embed_tokens.weight tensor")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"tensor_types": types_written, "rounding": rounding}


def _versions() -> dict[str, str]:
    import gguf

    versions = {"gguf": getattr(gguf, "__version__", None) or _dist_version("gguf")}
    try:
        import llama_cpp

        versions["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        versions["llama_cpp_python"] = "not installed"
    return versions


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """Write a dense or compressed-tensors checkpoint as a llama.cpp GGUF engine directory."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    prof = validate_profile(BACKEND, profile)
    config = read_config(checkpoint_dir)
    _check_architecture(config, f"{checkpoint_dir}/config.json")
    dequantized: str | None = None
    try:
        schemes = detect_schemes(checkpoint_dir)  # raises ValueError before any work for unsupported schemes
    except InexactWeights as e:
        if prof.inexact_weights == "error":
            raise
        schemes, dequantized = None, str(e)
    checkpoint_sha = sha256_tree(checkpoint_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    edir.clear_meta(out_dir)
    dense_state = None
    if dequantized:
        dense_state = {k: v.float() for k, v in load_dequantized(checkpoint_dir).state_dict().items()}
    try:
        written = write_gguf(checkpoint_dir, out_dir / GGUF_FILE, prof, dense_state)
    except InexactWeights as e:  # a layer's shapes no block holds: the same fallback, decided per checkpoint
        if prof.inexact_weights == "error":
            raise
        dequantized = str(e)
        dense_state = {k: v.float() for k, v in load_dequantized(checkpoint_dir).state_dict().items()}
        written = write_gguf(checkpoint_dir, out_dir / GGUF_FILE, prof, dense_state)
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    # the report's engine column: the decoder linears' block types ("q4_1", "q4_0+q8_0"), or the dense type
    blocks = sorted(t.lower() for t in written["tensor_types"] if t.startswith("Q"))
    precision = "+".join(blocks) if schemes else {"f32": "fp32", "f16": "fp16"}[prof.dense]
    return edir.write_meta(out_dir, edir.EngineMeta(
        backend=BACKEND,
        format=FORMAT,
        precision=precision,
        checkpoint_sha256=checkpoint_sha,
        dequantized=dequantized and {"reason": dequantized, "checkpoint_quantization": config["quantization_config"]},
        files=[GGUF_FILE],
        tokenizer_files=copied,
        build_identity=build_identity(),
        **_versions(),
        writer=WRITER,
        profile=prof.model_dump(),
        quantization={name: s.summary() for name, s in (schemes or {}).items()} or None,
        tensor_types=written["tensor_types"],
        rounding=written["rounding"],
        sampling={"method": "exact: the full fp32 logits of each step (llama_get_logits_ith)", "parameters": list(PARAMETERS)},
        checkpoint=str(checkpoint_dir.resolve()),
        device=device_fingerprint(),
    ))


def build_identity() -> str:
    """What decides whether an engine built earlier still loads here: the writer and the llama.cpp it targets."""
    v = _versions()
    return f"{BACKEND} {WRITER}, gguf {v['gguf']}, llama-cpp-python {v['llama_cpp_python']}"
