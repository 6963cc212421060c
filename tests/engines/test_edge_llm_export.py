"""The edge_llm backend's export phase with the real exporter: TensorRT Edge-LLM 0.11.0 (`tensorrt-edgellm[export]`
from PyPI, in a venv of its own that `make edgellm-venv` keeps and EDGEFLOW_EDGELLM_PYTHON names) run on this CPU by
`build(..., {"phase": "export"})`, on tiny Llama 3, Qwen2.5 and Qwen3 models quantized by the quantize stage's own
code (GPTQ W4A16, group 128: the layout Edge-LLM's int4 kernels load), and a group-64 checkpoint through the fp16
`dequantize` path. Each test reads the exported model.onnx with its external data and holds every weight to ours,
tensor by tensor: the int4 codes (unpacked from the cuteDSL plugin's fragment order) and float16 scales, every norm,
bias and embedding, or the fp16 values; and the exporter's config.json to the model's. About 20 s per export here."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgeflow.engines import get_backend
from edgeflow.engines.checkpoint import WeightScheme, layer, load_tensors, read_config
from edgeflow.model.tiny import VOCAB, build_tiny
from edgeflow.paths import REPO_ROOT
from tests.helpers.edge_llm import onnx_tensors, require_exporter, unpack_cutedsl_fragment

# Multiples of Edge-LLM's int4 group (128) and of the fragment layout's 64: q/o 128x128, k/v 64x128, MLP 256x128.
SIZE = dict(hidden_size=128, intermediate_size=256, head_dim=32)
# An export profile for a 256-position tiny model (the Orin profile's defaults exceed its context).
PROFILE = {"phase": "export", "max_input_len": 128, "max_kv_cache_capacity": 256}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _gptq_w4a16_g128(dense: Path, out: Path) -> Path:
    """The shipped GPTQ W4A16 recipe at group 128, run by the quantize stage's quantize() on random calibration ids."""
    from edgeflow.quantize.recipe import load_recipe
    from edgeflow.quantize.run import quantize

    recipe = load_recipe(REPO_ROOT / "deployments" / "recipes" / "gptq-w4a16-sym.yaml")
    recipe["quant_stage"]["quant_modifiers"]["GPTQModifier"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    rng = np.random.default_rng(0)
    quantize(dense, recipe, [rng.integers(8, VOCAB, 64).tolist() for _ in range(8)], out)
    return out


def _assert_config(export_dir: Path, checkpoint: Path) -> dict:
    """The exporter's config.json describes the checkpoint's model (and says which Edge-LLM wrote it)."""
    got = json.loads((export_dir / "onnx" / "llm" / "config.json").read_text())
    want = read_config(checkpoint)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):
        assert got[key] == want[key], (key, got[key], want[key])
    assert got["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"])
    assert got["edgellm_version"] == "0.11.0" and got["kv_cache_dtype"] == "fp16"
    return got


def _assert_dense_tensors(tensors: dict[str, np.ndarray], nodes: list, ours: dict[str, np.ndarray], export_dir: Path) -> None:
    """Every norm, bias and the embedding: ours in float16 (the engine's dtype), exactly."""
    fp16 = {k: v.astype(np.float16) for k, v in ours.items()}
    attention = [n for n in nodes if n.op_type == "AttentionPlugin"]  # one per layer, in order
    for name, want in fp16.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3: the attention plugin's q/k norm gammas
            i = int(name.split(".")[2])
            which = "q_norm_gamma" if "q_norm" in name else "k_norm_gamma"
            got = tensors[next(x for x in attention[i].input if x.startswith(which))]
        elif name == "model.embed_tokens.weight":
            from safetensors.numpy import load_file

            got = load_file(str(export_dir / "onnx" / "llm" / "embedding.safetensors"))["embedding"]
            if "lm_head.weight" not in fp16:  # tied: the exporter's lm_head is the embedding
                np.testing.assert_array_equal(tensors["_model.lm_head.weight"], want, err_msg="tied lm_head")
        else:
            got = tensors[f"_model.{name}"]
        assert got.dtype == np.float16, name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_gptq_w4a16_group128_student_exports_with_every_int4_code_and_scale_ours(family, tmp_path):
    require_exporter()
    dense = build_tiny(family, tmp_path / "dense", **SIZE)
    ckpt = _gptq_w4a16_g128(dense, tmp_path / "gptq")
    meta = get_backend("edge_llm").build(ckpt, tmp_path / "export", PROFILE)
    assert meta["precision"] == "int4_gptq" and meta["stage"] == "export" and meta["edge_llm_exporter"] == "0.11.0"
    config = _assert_config(tmp_path / "export", ckpt)
    assert config["model"] == read_config(ckpt)["model_type"]

    tensors, nodes = onnx_tensors(tmp_path / "export" / "onnx" / "llm" / "model.onnx")
    source = load_tensors(ckpt)
    scheme = WeightScheme(bits=4, strategy="group", group_size=128, symmetric=True, format="pack-quantized")
    gemms = [n for n in nodes if n.op_type == "Int4GroupwiseGemmPluginV2"]
    assert len(gemms) == len(LINEARS) * config["num_hidden_layers"]
    for i in range(config["num_hidden_layers"]):
        for lin in LINEARS:
            prefix = f"model.layers.{i}.{lin}"
            q = layer(source, prefix, scheme)
            n_out, n_in = q.q.shape
            codes = unpack_cutedsl_fragment(tensors[f"_model.{prefix}.qweight"], n_out, n_in)
            want = q.q.astype(np.int64) - np.repeat(q.zero.astype(np.int64), 128, axis=1) + 8  # the biased nibble
            np.testing.assert_array_equal(codes, want, err_msg=prefix)
            scales = tensors[f"_model.{prefix}.scales"]  # [groups, out], float16
            np.testing.assert_array_equal(scales, q.scale.astype(np.float16).T, err_msg=prefix)
    ours = {k: v for k, v in source.items() if not k.endswith(("weight_packed", "weight_scale", "weight_shape",
                                                                "weight_zero_point", "weight_g_idx"))}
    assert not [k for k in ours if any(k.endswith(f"{lin}.weight") for lin in LINEARS)]  # every linear was int4
    _assert_dense_tensors(tensors, nodes, ours, tmp_path / "export")


def test_a_group64_student_exports_fp16_through_dequantize_with_every_value_ours(tmp_path):
    """Group 64 is not an Edge-LLM int4 layout: with inexact_weights: dequantize the export is float16 of the
    checkpoint's exact (q - zero) * scale, and engine.json says so."""
    from edgeflow.quantize.rtn import rtn_int4

    require_exporter()
    dense = build_tiny("llama", tmp_path / "dense", **SIZE)
    ckpt = rtn_int4(dense, tmp_path / "g64", symmetric=False, group_size=64)
    meta = get_backend("edge_llm").build(ckpt, tmp_path / "export", PROFILE | {"inexact_weights": "dequantize"})
    assert meta["precision"] == "fp16" and "group_size=64" in json.dumps(meta["dequantized"])
    _assert_config(tmp_path / "export", ckpt)
    tensors, nodes = onnx_tensors(tmp_path / "export" / "onnx" / "llm" / "model.onnx")
    assert not [n for n in nodes if n.op_type.startswith("Int4")]
    source = load_tensors(ckpt)
    scheme = WeightScheme(bits=4, strategy="group", group_size=64, symmetric=False, format="pack-quantized")
    # the exporter names a dense linear's weight after its traced value (val_N), stored [in, out] for the MatMul, with
    # q, k and v fused into one: found by content, each of ours (q|k|v as one) must be exactly one of the export's
    # float16 matrices, and each matrix one of ours
    matrices = {tensors[x].T.tobytes(): x for x in tensors if tensors[x].ndim == 2 and tensors[x].dtype == np.float16
                and x != "_model.lm_head.weight"}
    found = set()

    def ours(prefix: str) -> np.ndarray:
        q = layer(source, prefix, scheme)
        return ((q.q.astype(np.float32) - np.repeat(q.zero, 64, 1).astype(np.float32))
                * np.repeat(q.scale, 64, 1)).astype(np.float16)

    for i in range(read_config(ckpt)["num_hidden_layers"]):
        p = f"model.layers.{i}"
        qkv = np.concatenate([ours(f"{p}.self_attn.{x}_proj") for x in "qkv"])
        for name, want in [(f"{p}.qkv", qkv)] + [(f"{p}.{lin}", ours(f"{p}.{lin}")) for lin in LINEARS[3:]]:
            assert want.tobytes() in matrices, f"{name}: no exported float16 matrix holds our dequantized weights"
            found.add(matrices[want.tobytes()])
    assert found == set(matrices.values()), sorted(set(matrices.values()) - found)
