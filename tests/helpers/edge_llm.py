"""Reading what TensorRT Edge-LLM's exporter wrote (tests/engines/test_edge_llm_export.py): the exporter's interpreter
(its own venv, EDGEFLOW_EDGELLM_PYTHON), an ONNX export's tensors with their external data, and the int4 weights
unpacked from the cuteDSL fragment order of Int4GroupwiseGemmPluginV2 back to [out, in] nibbles."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np

from edgeflow.engines.edge_llm.plan import EXPORTER_PYTHON_ENV
from tests.helpers.require import lacking


def require_exporter() -> str:
    """The interpreter with tensorrt-edgellm installed (`make test` sets EDGEFLOW_EDGELLM_PYTHON to the venv `make
    edgellm-venv` keeps); skipped without one, a failure in CI (tests/helpers/require.py)."""
    python = os.environ.get(EXPORTER_PYTHON_ENV, "")
    ok = bool(python) and Path(python).exists() and subprocess.run(
        [python, "-c", "import tensorrt_edgellm.scripts.export"], capture_output=True).returncode == 0
    if ok:
        return python
    lacking(f"TensorRT Edge-LLM's exporter is not installed for {EXPORTER_PYTHON_ENV}={python or '(unset)'}",
            "`make edgellm-venv` makes its venv, and `make test` points the tests at it")


def onnx_tensors(model_onnx: Path) -> tuple[dict[str, np.ndarray], list]:
    """(every initializer by name, with its external data; the graph's nodes) of an exported model.onnx."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(model_onnx), load_external_data=True)
    return {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}, list(m.graph.node)


# The fragment order of the cuteDSL W4A16 kernel (Int4GroupwiseGemmPluginV2), bN = 128 output rows by bK = 64 input
# columns per tile: each of 128 threads holds, per 16-column K block and per pair of 64-row N halves, one 32-bit word
# of 8 nibbles, each (bit shift, from the upper 32 rows of the half, K offset). Nibbles are biased: n = q - zero + 8.
BN, BK, THREADS = 128, 64, 128
NIBBLES = ((0, False, 0), (4, False, 8), (8, True, 0), (12, True, 8), (16, False, 1), (20, False, 9), (24, True, 1),
           (28, True, 9))


def unpack_cutedsl_fragment(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    """Biased nibbles [n, k] (0..15) from the exporter's int8 [rows, 512] fragment buffer; asserts the buffer has the
    layout's size and that every (row, column) is read exactly once."""
    k_blocks, n_pairs = BK // 16, BN // 64
    per_tile = k_blocks * n_pairs
    n_blocks, k_tiles = -(-n // BN), -(-k // BK)
    words = np.ascontiguousarray(packed).view(np.uint32).reshape(-1, THREADS).astype(np.int64)
    assert words.shape[0] == n_blocks * k_tiles * per_tile, (packed.shape, n, k)
    out = np.full((n_blocks * BN, k_tiles * BK), -1, dtype=np.int64)
    for t in range(THREADS):
        n_base, kb = t // 4, 2 * (t % 4)
        for kbl in range(k_blocks):
            for p in range(n_pairs):
                for nb in range(n_blocks):
                    for kt in range(k_tiles):
                        w = int(words[(nb * k_tiles + kt) * per_tile + kbl * n_pairs + p, t])
                        n_lo = nb * BN + n_base + 64 * p
                        k0 = kt * BK + 16 * kbl + kb
                        for shift, hi, koff in NIBBLES:
                            row, col = (n_lo + 32 if hi else n_lo), k0 + koff
                            assert out[row, col] == -1, (row, col)
                            out[row, col] = (w >> shift) & 0xF
    assert (out >= 0).all()
    return out[:n, :k]
