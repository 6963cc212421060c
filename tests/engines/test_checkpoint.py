"""The one checkpoint reader (edgeflow/engines/checkpoint.py) and the typed engine.json (edgeflow/engines/engine_dir.py).

Synthetic compressed-tensors layers with known integers: what `layer` returns must be exactly what was
packed, and the GPTQ layout must dequantize to the same numbers. The real llm-compressor checkpoints are
covered through the backends (test_cpu_onnx's bit-exact repack against transformers' own dequantization).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgeflow.engines import EngineIncompatibleError
from edgeflow.engines import engine_dir as edir
from edgeflow.engines.checkpoint import (
    InexactWeights,
    WeightScheme,
    gptq_layer,
    int4_group_scheme,
    layer,
    pack_int32_le,
    unpack_int32_le,
    weight_schemes,
)


def _packed_layer(rng, n_out=16, n_in=128, bits=4, gs=64, symmetric=False):
    off = 1 << (bits - 1)
    q = rng.integers(0, 1 << bits, size=(n_out, n_in), dtype=np.uint8)
    zero = np.full((n_out, n_in // gs), off, np.uint8) if symmetric else rng.integers(1, 1 << bits, (n_out, n_in // gs), dtype=np.uint8)
    scale = rng.uniform(0.01, 0.1, size=(n_out, n_in // gs)).astype(np.float32)
    tensors = {"p.weight_packed": pack_int32_le(q, bits), "p.weight_scale": scale,
               "p.weight_shape": np.array([n_out, n_in], dtype=np.int64)}
    if not symmetric:
        tensors["p.weight_zero_point"] = np.ascontiguousarray(pack_int32_le(np.ascontiguousarray(zero.T), bits).T)
    scheme = WeightScheme(bits=bits, strategy="group", group_size=gs, symmetric=symmetric, format="pack-quantized")
    return tensors, scheme, (q, zero, scale)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits):
    v = np.random.default_rng(0).integers(0, 1 << bits, size=(3, 64), dtype=np.uint8)
    words = pack_int32_le(v, bits)
    assert words.dtype == np.int32 and words.shape == (3, 64 * bits // 32)
    np.testing.assert_array_equal(unpack_int32_le(words, bits), v)


@pytest.mark.parametrize("symmetric", [False, True])
def test_layer_returns_the_stored_integers_and_gptq_dequantizes_to_the_same_weights(symmetric):
    tensors, scheme, (q, zero, scale) = _packed_layer(np.random.default_rng(1), symmetric=symmetric)
    got = layer(tensors, "p", scheme)
    np.testing.assert_array_equal(got.q, q)
    np.testing.assert_array_equal(got.zero, zero)
    np.testing.assert_array_equal(got.scale, scale)
    assert got.group_size == 64
    g = gptq_layer(got, 4)
    dq = unpack_int32_le(np.ascontiguousarray(g["qweight"].T), 4).astype(np.float32)  # [out, in]
    dz = ((unpack_int32_le(g["qzeros"], 4).astype(np.int16) + 1) & 0xF).astype(np.float32).T  # [out, groups]
    want = (q.astype(np.float32) - np.repeat(zero, 64, 1)) * np.repeat(scale, 64, 1)
    np.testing.assert_array_equal((dq - np.repeat(dz, 64, 1)) * np.repeat(g["scales"].T, 64, 1), want)
    np.testing.assert_array_equal(g["g_idx"], np.arange(128) // 64)


def test_act_order_and_bad_shapes_are_refused():
    tensors, scheme, _ = _packed_layer(np.random.default_rng(2))
    permuted = dict(tensors, **{"p.weight_g_idx": np.random.default_rng(3).permutation(128) // 64})
    with pytest.raises(InexactWeights, match="act-order"):
        layer(permuted, "p", scheme)
    short = dict(tensors, **{"p.weight_scale": tensors["p.weight_scale"][:, :1]})
    with pytest.raises(ValueError, match=r"do not match weight \[16, 128\] in groups of 64"):
        layer(short, "p", scheme)


def _config(weights: dict, **qc) -> dict:
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}, **qc}}


W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}


def test_weight_schemes_types_each_group_and_refuses_what_no_engine_builds():
    assert weight_schemes({}) is None
    s = weight_schemes(_config(W4))["g"]
    assert (s.bits, s.strategy, s.group_size, s.symmetric, s.format) == (4, "group", 64, True, "pack-quantized")
    assert weight_schemes(_config({**W4, "strategy": "channel"}))["g"].group_size is None
    for qc, pattern in [({"quant_method": "gptq"}, r"quant_method='gptq'"), ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache"),
                        ({"sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
                        ({"config_groups": {}}, "config_groups is empty")]:
        with pytest.raises(ValueError, match=pattern):
            weight_schemes(_config(W4, **qc), engine="x")
    with pytest.raises(ValueError, match="activation quantization"):
        weight_schemes({"quantization_config": {**_config(W4)["quantization_config"], "config_groups": {
            "g": {"weights": W4, "input_activations": {"num_bits": 8}}}}})


@pytest.mark.parametrize("edit, pattern", [({"num_bits": 8}, "num_bits=8"), ({"group_size": 128}, r"group_size=128: K group sizes are \(64,\)"),
                                           ({"strategy": "channel"}, "strategy='channel'"), ({"actorder": "group"}, "actorder='group'")])
def test_int4_group_scheme_names_what_the_kernel_cannot_hold(edit, pattern):
    assert int4_group_scheme(weight_schemes(_config(W4)), "c", (64,), "K").group_size == 64
    with pytest.raises(InexactWeights, match=pattern):
        int4_group_scheme(weight_schemes(_config({**W4, **edit})), "c", (64,), "K")


def test_engine_meta_reads_checks_and_migrates_legacy_file_lists(tmp_path):
    with pytest.raises(EngineIncompatibleError, match="no engine.json; not an edgeflow engine directory"):
        edir.read_meta(tmp_path)
    (tmp_path / "engine.json").write_text("{not json")
    with pytest.raises(EngineIncompatibleError, match="not a valid edgeflow engine.json"):
        edir.read_meta(tmp_path)
    legacy = {"backend": "cpu", "precision": "int4", "checkpoint_sha256": "ab" * 32, "model_files": ["model.onnx"],
              "onnxruntime_genai": "0.18.0"}
    (tmp_path / "engine.json").write_text(json.dumps(legacy))
    meta = edir.read_meta(tmp_path)
    assert meta.files == ["model.onnx"] and meta.extra("onnxruntime_genai") == "0.18.0" and meta.label == "int4"
    with pytest.raises(EngineIncompatibleError, match="engine files missing: \\['model.onnx'\\]"):
        edir.check_meta(tmp_path, "cpu")
    (tmp_path / "model.onnx").write_bytes(b"")
    assert edir.check_meta(tmp_path, "cpu").backend == "cpu"
    with pytest.raises(EngineIncompatibleError, match="engine backend is 'cpu' but this device runs backend 'cpu_native'"):
        edir.check_meta(tmp_path, "cpu_native")
    written = edir.write_meta(tmp_path, {**legacy, "dequantized": {"reason": "num_bits=8", "checkpoint_quantization": {}}})
    assert written["files"] == ["model.onnx"] and "model_files" not in written
    assert edir.read_meta(tmp_path).label == "int4 (dequantized)"
    with pytest.raises(ValueError, match="precision"):
        edir.write_meta(tmp_path, {"backend": "cpu", "checkpoint_sha256": "x", "files": []})
