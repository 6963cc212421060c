"""A real MLflow server for the session, and releases recorded in it the way the stages record them."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import httpx
import pytest
import yaml

from tests.helpers.ports import free_port

REPO = Path(__file__).resolve().parents[2]
RECIPES = {
    "gptq-w4a16": "deployments/recipes/gptq-w4a16-sym.yaml",
    "rtn-w4a16": "deployments/recipes/rtn-w4a16-asym.yaml",
    "mixed-w8attn-w4mlp": "deployments/recipes/mixed-w8attn-w4mlp.yaml",
}
# The gate threshold of the profile make_release writes: a variant passes at this top-1 agreement or above.
MIN_TOP1 = 0.97
# Calibration set of the tiny student: enough samples of ids below its vocab (512) for GPTQ's Hessians.
CALIBRATION_SAMPLES, CALIBRATION_TOKENS = 8, 32


@dataclass
class MlflowServer:
    """A started `mlflow server` process; `wait` blocks until it answers /health."""

    url: str
    proc: subprocess.Popen
    log: Path

    def wait(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        # One client for every poll: each new httpx client loads the CA bundle (~0.1 s of CPU on this box).
        with httpx.Client(timeout=2) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mlflow server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return self.url
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server on {self.url} not healthy after {timeout:.0f} s: {self.log.read_text()[-2000:]}")
                time.sleep(0.5)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """`mlflow server` on SQLite at a free port, one for the session, proxying its artifact store as the services'
    server does (`--artifacts-destination`): run artifact URIs are mlflow-artifacts:/…, fetched over HTTP.

    It is only started here: it boots (~20 s on 2 cores) while the session's other fixtures build the tiny
    model, and `mlflow_tracking` waits for it.
    """
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    with open(root / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
             "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,  # its own group: the uvicorn child stops with it
            # No background job runner (traces, scorers): unused here, and one process less to start and stop on 2 cores.
            env=os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
    try:
        yield MlflowServer(f"http://127.0.0.1:{port}", proc, root / "server.log")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def mlflow_tracking(mlflow_server) -> Iterator[str]:
    """MLFLOW_TRACKING_URI points at the session's server, once healthy, while a module that uses it runs."""
    url = mlflow_server.wait()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", url)
        yield url


@pytest.fixture(scope="session")
def stage_results() -> dict:
    """Task results by the tasks' own Prefect cache key, for the whole session (see make_release)."""
    return {}


@pytest.fixture(scope="session")
def calibration_rows(tiny_llama) -> list[dict]:
    """Calibration samples with the columns edgeflow/calibration/mix.py:build_calibration_set writes, ids below 512."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    rng = random.Random(0)
    rows = []
    for i in range(CALIBRATION_SAMPLES):
        ids = [rng.randrange(512) for _ in range(CALIBRATION_TOKENS)]
        rows.append({"domain": ("chat", "wiki")[i % 2], "source_index": i, "text": tok.decode(ids), "input_ids": ids,
                     "n_tokens": len(ids), "truncated": False})
    return rows


@dataclass
class Release:
    """What a recorded release left behind: its profile, context, stage outputs and register result."""

    profile_path: Path
    profile: object
    ctx: object
    teacher: object
    student: object
    calibration: object
    quantized: dict
    engines: dict
    gate_report: object
    registry: dict

    def version(self, variant: str) -> str:
        return self.registry["registered"][variant]


@pytest.fixture(scope="module")
def make_release(mlflow_server, tiny_llama, calibration_rows, stage_results, mlflow_tracking, tmp_path_factory) -> Callable[..., Release]:
    """Record a release in MLflow through the stages' own code: the real parent run, the real quantize and
    build-engine task bodies on a tiny Llama student (llm-compressor and the CPU engine builder), distill,
    calibrate and consistency runs written with the stages' helpers, and the real register stage.

    variants: {name: top-1 agreement at the gate}; a variant passes at MIN_TOP1 or above.
    training_set=False records a distill run that predates the training-set tag.

    Every release copies the same student and writes the same calibration set, so quantize and build-engine
    have the same inputs each time: like the tasks' Prefect cache (cache_key_fn=content_key), a release
    reuses the result an earlier release computed for the same key instead of quantizing again.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from edgeflow.pipeline.build_engine import build_one
    from edgeflow.pipeline.consistency import engine_precision
    from edgeflow.pipeline.quantize import quantize_variant
    from edgeflow.pipeline.register import register_passing
    from edgeflow.pipeline.release import open_release
    from edgeflow.tracking.artifacts import ArtifactRef, sha256_tree
    from edgeflow.preflight import load_profile
    from edgeflow.engines import get_backend
    from edgeflow.quantize.recipe import load_recipe
    from edgeflow.tracking.runs import content_key, log_training_set, stage_run
    from edgeflow.tracking.store import materialize, publish

    def cached(task, **params):
        key = content_key(SimpleNamespace(task=task), params)
        if key not in stage_results:
            stage_results[key] = task.fn(**params)
        return stage_results[key]

    def make(model_name: str, variants: dict[str, float], training_set: bool = True) -> Release:
        root = tmp_path_factory.mktemp("release")
        profile_path = root / "profile.yaml"
        profile_path.write_text(yaml.safe_dump({
            "name": "promo-test", "workdir": str(root / "work"),
            "calibration": {"total": CALIBRATION_SAMPLES, "min_total": CALIBRATION_SAMPLES, "max_tokens": CALIBRATION_TOKENS},
            "quantize": {"variants": [{"name": n, "recipe": RECIPES[n]} for n in variants]},
            "gate": {"min_top1_agreement": MIN_TOP1},
            "registry": {"model_name": model_name, "experiment": f"{model_name}-releases"},
            "deploy": {"install_dir": str(root / "device")},
        }))
        profile = load_profile(profile_path)
        ctx = open_release.fn(str(profile_path), profile)
        teacher_dir = root / "teacher"
        teacher_dir.mkdir()
        (teacher_dir / "model.safetensors").write_bytes(os.urandom(256))
        teacher = ArtifactRef(kind="teacher", uri=f"local:{teacher_dir}", sha256=sha256_tree(teacher_dir), meta={"source": "local"})

        cfg = profile.distill  # as edgeflow/pipeline/distill.py:train_student records its run
        with stage_run(ctx, "distill", cfg.model_dump() | {"teacher_sha256": teacher.sha256}) as (client, run_id):
            if training_set:
                log_training_set(client, run_id, {c: profile.resolve(c) for c in cfg.corpora})
            out = profile.work / "artifacts" / "student"
            shutil.copytree(tiny_llama, out)
            student = publish(client, run_id, out, "student", "student", meta={"teacher": teacher.model_dump()})

        with stage_run(ctx, "calibrate", profile.calibration.model_dump()) as (client, run_id):  # as edgeflow/pipeline/calibrate.py
            out = profile.work / "artifacts" / "calibration" / "calibration.parquet"
            out.parent.mkdir(parents=True)
            pq.write_table(pa.Table.from_pylist(calibration_rows), out)
            counts = {d: sum(r["domain"] == d for r in calibration_rows) for d in ("chat", "wiki")}
            calibration = publish(client, run_id, out, "calibration", "calibration",
                                  meta={"total": len(calibration_rows), "counts": counts})

        # as edgeflow/pipeline/quantize.py:quantize and edgeflow/pipeline/build_engine.py:build_engine call their tasks
        quantized = {v.name: cached(quantize_variant, student=student, calibration=calibration, variant=v,
                                    recipe=load_recipe(profile.resolve(v.recipe), profile.quantize.recipe_overrides), ctx=ctx)
                     for v in profile.quantize.variants}
        checkpoints = {"fp32": student, **quantized}
        builder = get_backend(profile.engine.backend).build_identity()
        engines = {name: cached(build_one, checkpoint=ref, engine=profile.engine, name=name, ctx=ctx, builder=builder)
                   for name, ref in checkpoints.items()}

        # What the gate measured is test data; sizes, precisions and refs are the real artifacts' (as edgeflow/pipeline/consistency.py).
        rows, gate = [], profile.gate
        for name, ckpt in checkpoints.items():
            top1 = 1.0 if name == "fp32" else variants[name]
            passed = top1 >= gate.min_top1_agreement
            size = ckpt.meta.get("size_mb") or sum(f.stat().st_size for f in materialize(ckpt).rglob("*.safetensors")) / 2**20
            rows.append({
                "name": name, "size_mb": round(size, 1), "engine_precision": engine_precision(materialize(engines[name])),
                "decode_tok_s": 50.0, "ttft_ms": 20.0, "top1_agreement": top1, "top1_last": top1, "kl": 0.01, "kl_p99": 0.05,
                "ppl": 10.0, "greedy_exact": 1.0, "passed": passed, "quantized": name != "fp32",
                "reasons": [] if passed else [f"top-1 agreement {top1:.2%} < {gate.min_top1_agreement:.2%}"],
                "metrics": {"engine_parity": 1.0},
                "checkpoint": ckpt.model_dump(), "engine": engines[name].model_dump(),
            })
        with stage_run(ctx, "consistency", gate.model_dump() | {"backend": "cpu"}) as (client, run_id):
            out = profile.work / "releases" / ctx.release_id / "gate-attempt0.json"  # as edgeflow/pipeline/consistency.py
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"thresholds": gate.model_dump(exclude={"eval_sources"}), "attempt": 0, "rows": rows}))
            gate_report = publish(client, run_id, out, "gate", "gate-report")

        registry = register_passing.fn(gate_report, {"teacher": teacher, "student": student, "calibration": calibration}, ctx)
        return Release(profile_path, profile, ctx, teacher, student, calibration, quantized, engines, gate_report, registry)

    return make
