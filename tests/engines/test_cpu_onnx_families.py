"""The cpu backend (onnxruntime-genai) on the families its builder takes (edgeflow/model/architecture.py BACKEND_FAMILIES["cpu"]):
tiny random Llama 3.x (llama3 RoPE), Qwen2 and Qwen3 models from tests/helpers/families.py, with the SmolLM2 teacher's
tokenizer files (the builder needs one; ids stay below the tiny vocabulary). fp32 logits within LOGIT_BOUND of
transformers' (4e-6 to 6e-6 measured on the AMD EPYC, AVX-512 BF16 box) and the same greedy tokens. About 30 s on
2 CPU cores."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime_genai")

from edgeflow.model.architecture import BACKEND_FAMILIES, RUNS  # noqa: E402
from edgeflow.engines import cpu_onnx  # noqa: E402
from edgeflow.engines.checkpoint import copy_tokenizer_files, load_dequantized  # noqa: E402
from tests.helpers.families import build_tiny  # noqa: E402

LOGIT_BOUND = 1e-4
FAMILIES = [mt for mt, verdict in BACKEND_FAMILIES["cpu"].items() if verdict == RUNS]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fp32_logits_and_greedy_tokens_match_transformers(model_type: str, teacher_dir: Path, tmp_path: Path) -> None:
    model_dir = build_tiny(model_type, tmp_path / model_type)
    copy_tokenizer_files(teacher_dir, model_dir)
    cpu_onnx.build(model_dir, tmp_path / "engine", {})
    session = cpu_onnx.load(tmp_path / "engine")
    model = load_dequantized(model_dir)
    seq = list(range(3, 40))
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0].numpy()
        want = model.generate(torch.tensor([seq[:9]]), attention_mask=torch.ones(1, 9, dtype=torch.long), max_new_tokens=8,
                              min_new_tokens=8, do_sample=False, pad_token_id=0)[0, 9:].tolist()
    assert float(np.abs(cpu_onnx.score(session, seq) - ref).max()) < LOGIT_BOUND
    assert list(cpu_onnx.generate(session, seq[:9], 8, [])) == want


def test_a_family_the_builder_cannot_take_is_refused_before_any_work(tmp_path: Path) -> None:
    model_dir = build_tiny("gemma3_text", tmp_path / "gemma3")
    with pytest.raises(ValueError, match=r"Gemma 3 family .* cannot run on engine.backend=cpu: .*KeyError 'rope_type'.*"
                                         r"backends that run it: cpu_native, llama_cpp, tensorrt_llm, vllm"):
        cpu_onnx.build(model_dir, tmp_path / "engine", {})
    assert not (tmp_path / "engine").exists()
