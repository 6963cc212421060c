"""Pre-quantized checkpoints (edgeflow/engines/checkpoint.py import_prequantized): AutoAWQ GEMM and GPTQ (AutoGPTQ v1,
GPTQModel v2, act-order) int4 checkpoints written here in those layouts, imported bit-exactly as compressed-tensors.

The layouts are written from the format descriptions (AutoAWQ's WQLinear_GEMM pack order, AutoGPTQ's qweight packed
along inputs and zero - 1 in qzeros, GPTQModel's v2 storing the zero point itself, act-order's g_idx), from an
llm-compressor RTN checkpoint of a tiny Qwen2 (q/k/v biases) whose integers the import must give back exactly.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")

from edgeflow.engines import checkpoint as ck  # noqa: E402
from edgeflow.engines import cpu_native  # noqa: E402
from tests.helpers.families import build_tiny, rtn_int4  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _export_teacher() -> None:
    """These tests need no teacher: override the engines-wide autouse fixture of tests/conftest.py."""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prequantized")
    dense = build_tiny("qwen2", root / "dense")
    return {"dense": dense, "asym": rtn_int4(dense, root / "asym"), "sym": rtn_int4(dense, root / "sym", symmetric=True)}


def _layers(path: Path) -> dict[str, ck.QuantizedLayer]:
    scheme = next(iter(ck.weight_schemes(ck.read_config(path)).values()))
    return dict(ck.quantized_layers(ck.load_tensors(path), scheme, path))


def _write_awq_gemm(ct: Path, out: Path) -> None:
    """AutoAWQ's GEMM layout: qweight [in, out/8] and qzeros [groups, out/8], 8 output columns a word in the order
    0 2 4 6 1 3 5 7; scales [groups, out] fp16; quantization_config quant_method awq, version gemm."""
    from safetensors.numpy import save_file

    tensors = ck.load_tensors(ct)
    dense, prefixes = ck.split_tensors(tensors, ct)
    out_t = dict(dense)
    layers = _layers(ct)

    def pack_cols(v: np.ndarray) -> np.ndarray:  # [rows, out] -> [rows, out/8], AWQ's interleave
        v = v.reshape(v.shape[0], -1, 8)[:, :, list(ck.AWQ_ORDER)]
        return ck.pack_int32_le(v.reshape(v.shape[0], -1), 4)

    for p in prefixes:
        q = layers[p]
        out_t[f"{p}.qweight"] = pack_cols(np.ascontiguousarray(q.q.T))
        out_t[f"{p}.qzeros"] = pack_cols(np.ascontiguousarray(q.zero.T))
        out_t[f"{p}.scales"] = np.ascontiguousarray(q.scale.T.astype(np.float16))
    out.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in out_t.items()}, str(out / "model.safetensors"))
    cfg = ck.read_config(ct)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(cfg))


def _fp16_scales(ct: Path, out: Path) -> Path:
    """The RTN checkpoint with its scales rounded to fp16, as AWQ and GPTQ checkpoints store them (the import widens
    them to fp32 exactly; the reference must hold the same values)."""
    from safetensors.numpy import save_file

    shutil.copytree(ct, out)
    t = ck.load_tensors(ct)
    t = {k: (v.astype(np.float16).astype(np.float32) if k.endswith(".weight_scale") else v) for k, v in t.items()}
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("layout", ["awq-gemm", "gptq-v1", "gptq-v2", "gptq-v1-sym"])
def test_an_imported_checkpoint_holds_the_same_integers_and_runs_the_same(layout: str, source, tmp_path: Path) -> None:
    ref = _fp16_scales(source["sym" if layout.endswith("sym") else "asym"], tmp_path / "ref")
    src = tmp_path / layout
    if layout == "awq-gemm":
        _write_awq_gemm(ref, src)
    else:
        scheme = next(iter(ck.weight_schemes(ck.read_config(ref)).values()))
        ck.write_gptq_int4(ref, src, scheme)  # AutoGPTQ v1: zero - 1
        if layout == "gptq-v2":  # GPTQModel v2: the zero point itself
            from safetensors.numpy import save_file

            t = ck.load_tensors(src)
            for k in [k for k in t if k.endswith(".qzeros")]:
                t[k] = ck.pack_int32_le((ck.unpack_int32_le(t[k], 4).astype(np.int16) + 1).astype(np.uint8) & 15, 4)
            save_file(t, str(src / "model.safetensors"))
            cfg = ck.read_config(src)
            cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
            (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"an AutoAWQ/GPTQ checkpoint; import it once.*python -m edgeflow.engines.checkpoint import"):
        cpu_native.build(src, tmp_path / "refused", {})
    scheme = ck.import_prequantized(src, tmp_path / "imported")
    assert (scheme.bits, scheme.group_size, scheme.symmetric) == (4, 64, layout.endswith("sym"))
    want, got = _layers(ref), _layers(tmp_path / "imported")
    assert want.keys() == got.keys()
    for p in want:
        assert np.array_equal(want[p].q, got[p].q) and np.array_equal(want[p].zero, got[p].zero), p
        assert np.array_equal(want[p].scale, got[p].scale), p
    a, b = ck.load_dequantized(ref), ck.load_dequantized(tmp_path / "imported")
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    cpu_native.build(tmp_path / "imported", tmp_path / "engine", {})
    session = cpu_native.load(tmp_path / "engine")
    ids = list(range(5, 25))
    with torch.no_grad():
        out = b.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=10,
                         min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert list(cpu_native.generate(session, ids, 10, [])) == out[0, len(ids):].tolist()
    assert session.meta["weights"] == "int4-g64"


def test_act_order_gptq_keeps_its_group_index_and_dequantizes_exactly(source, tmp_path: Path) -> None:
    """desc_act=True: each column's group comes from g_idx, not its position. compressed-tensors 0.19 has no form for
    it, so the import writes the exact weights (q - zero[g_idx]) * scale[g_idx], column by column, dense."""
    from safetensors.numpy import save_file

    src = tmp_path / "actorder"
    ref = _fp16_scales(source["asym"], tmp_path / "ref")
    scheme = next(iter(ck.weight_schemes(ck.read_config(ref)).values()))
    ck.write_gptq_int4(ref, src, scheme)
    t = ck.load_tensors(src)
    rng = np.random.default_rng(0)
    expected = {}
    for k in [k for k in t if k.endswith(".g_idx")]:
        p = k[: -len(".g_idx")]
        n_in = t[k].shape[0]
        g_idx = (rng.permutation(n_in) // 64).astype(np.int32)  # every group keeps 64 columns, scattered
        t[k] = g_idx
        q = ck.unpack_int32_le(np.ascontiguousarray(t[f"{p}.qweight"].T), 4).astype(np.float32)
        zero = ((ck.unpack_int32_le(t[f"{p}.qzeros"], 4).astype(np.int16) + 1) & 15).T.astype(np.float32)
        scale = t[f"{p}.scales"].astype(np.float32).T
        expected[p] = (q - zero[:, g_idx]) * scale[:, g_idx]
    save_file(t, str(src / "model.safetensors"))
    cfg = ck.read_config(src)
    cfg["quantization_config"]["desc_act"] = True
    (src / "config.json").write_text(json.dumps(cfg))
    scheme = ck.import_prequantized(src, tmp_path / "imported")
    assert (scheme.actorder, scheme.format, scheme.bits, scheme.group_size) == ("group", "gptq", 4, 64)
    cfg = ck.read_config(tmp_path / "imported")
    assert "quantization_config" not in cfg and cfg["edgeflow_imported_from"]["desc_act"] is True
    sd = ck.load_dequantized(tmp_path / "imported").state_dict()
    for p, w in expected.items():
        assert np.array_equal(sd[f"{p}.weight"].numpy(), w.astype(np.float32)), p
    assert cpu_native.build(tmp_path / "imported", tmp_path / "engine", {})["weights"] == "fp32"


def test_layouts_not_read_are_refused_naming_the_field(source, tmp_path: Path) -> None:
    src = tmp_path / "gemv"
    _write_awq_gemm(source["asym"], src)
    cfg = ck.read_config(src)
    cfg["quantization_config"]["version"] = "gemv"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"version='gemv' .*only AutoAWQ's GEMM layout"):
        ck.import_prequantized(src, tmp_path / "out")
    with pytest.raises(ValueError, match=r"quant_method=None: not an AutoAWQ or GPTQ checkpoint"):
        ck.import_prequantized(source["dense"], tmp_path / "out")


def test_a_variant_quantized_elsewhere_is_adopted_against_its_student(source, tmp_path: Path) -> None:
    """quantize.variants[].prequantized (edgeflow/quantize/run.py adopt): an AutoAWQ checkpoint of the student becomes the
    variant's compressed-tensors checkpoint with the same integers, its weight error measured against the student; a
    compressed-tensors one is taken as it is; another model, or a dense one, is refused naming what differs."""
    from edgeflow.tracking.artifacts import verify_manifest
    from edgeflow.quantize.run import adopt

    ref = _fp16_scales(source["asym"], tmp_path / "ref")
    _write_awq_gemm(ref, tmp_path / "awq")
    info = adopt(source["dense"], tmp_path / "awq", tmp_path / "adopted")
    verify_manifest(tmp_path / "adopted")
    assert info["prequantized_from"] == "awq" and info["scheme"]["bits"] == 4 and info["scheme"]["group_size"] == 64
    want, got = _layers(ref), _layers(tmp_path / "adopted")
    assert all(np.array_equal(want[p].q, got[p].q) and np.array_equal(want[p].scale, got[p].scale) for p in want)
    assert set(info["weight_error"]) and all(0 < e < 1 for e in info["weight_error"].values())
    assert (tmp_path / "adopted" / "tokenizer.json").exists()  # the checkpoint's, else the student's

    ct = adopt(source["dense"], source["sym"], tmp_path / "ct")
    assert ct["prequantized_from"] == "compressed-tensors" and ct["scheme"]["symmetric"] is True

    other = build_tiny("qwen2", tmp_path / "other-model", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"must be the student's model quantized; its config.json differs in "
                                         r"\{'num_hidden_layers': \{'checkpoint': 3, 'student': 2\}"):
        adopt(other, tmp_path / "awq", tmp_path / "refused")
    with pytest.raises(ValueError, match=r"has no quantization_config: a pre-quantized variant names"):
        adopt(source["dense"], source["dense"], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
