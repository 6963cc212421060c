"""Multi-process distillation: process count, the DeepSpeed config and torchrun command as pure functions, and the
same tiny training run in one process and in two processes launched by the real torchrun (gloo on this CPU)."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from edgeflow.paths import REPO_ROOT, user_cache
from edgeflow.profile import DistillConfig
from edgeflow.distill import run_distill
from edgeflow.distill.launch import distill_runner, launch_command, resolve_processes, run_distill_distributed, zero_config
from edgeflow.tracking.runs import mlflow_step_logger
from tests.helpers.distill import require_deepspeed

SHIPPED_ZERO3 = REPO_ROOT / "deployments" / "deepspeed" / "zero3-bf16.json"
# One training, run in one process and in two: global batch 4 over texts of different lengths (padding differs between
# the 4-sequence batch and each process's 2), the hidden-state term through a learned projection, a checkpoint at step 2.
# fp32 (mixed_precision off): these tests hold N processes to the one-process training at rel 1e-4, and bf16 autocast's
# rounding depends on the batch shape each process multiplies, which is not what they are about
RUN = dict(steps=4, batch_size=4, max_seq_len=16, lr=1e-3, beta=0.5, temperature=2.0, checkpoint_every=2, seed=3,
           mixed_precision="off")
EVAL = ["The cat sat on the mat.", "Two plus two is four, and four plus four is eight."]
# The kill-and-resume run: long enough that the kill, sent the moment the first checkpoint (step 2) is in place, lands
# well before the end. Two ZeRO-3 steps and a checkpoint of the tiny pair took ~0.3 s on the 2-core AVX2 EPYC (38
# steps in 4.8 s), so 80 steps leave ~11 s after step 2, against a poll every 20 ms.
KILL_STEPS = 80


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as each launched process has (OMP_NUM_THREADS=1): the same kernels on both sides."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------- pure functions


def test_launch_command_is_torchrun_standalone_from_this_interpreter(tmp_path):
    import sys

    cmd = launch_command(4, tmp_path / "spec.json")
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                   "-m", "edgeflow.distill.launch", "--spec", str(tmp_path / "spec.json")]


def test_process_count_comes_from_the_config_the_a100_job_or_the_visible_gpus():
    auto = DistillConfig()
    assert resolve_processes(auto, env={}, cuda_devices=0) == 1  # a CPU box: one process, plain torch
    assert resolve_processes(auto, env={"EDGEFLOW_GPUS": "4"}, cuda_devices=0) == 1  # no CUDA: the job's count is moot
    assert resolve_processes(auto, env={"EDGEFLOW_GPUS": "4"}, cuda_devices=8) == 4  # the pod's share of a bigger node
    assert resolve_processes(auto, env={}, cuda_devices=2) == 2
    assert resolve_processes(DistillConfig(processes=2, strategy="ddp"), env={"EDGEFLOW_GPUS": "8"}, cuda_devices=0) == 2
    with pytest.raises(ValueError, match=r"EDGEFLOW_GPUS=8 asks for 8 training processes.*only 4 CUDA device"):
        resolve_processes(auto, env={"EDGEFLOW_GPUS": "8"}, cuda_devices=4)
    with pytest.raises(ValueError, match=r"EDGEFLOW_GPUS='two' is not a GPU count"):
        resolve_processes(auto, env={"EDGEFLOW_GPUS": "two"}, cuda_devices=1)
    with pytest.raises(ValueError, match=r"distill.batch_size=2 is smaller than the 4 training processes"):
        resolve_processes(DistillConfig(batch_size=2), env={"EDGEFLOW_GPUS": "4"}, cuda_devices=4)
    with pytest.raises(ValueError, match=r"batch_size=6 does not split evenly across 4 processes.*strategy: ddp"):
        resolve_processes(DistillConfig(batch_size=6), env={}, cuda_devices=4)
    assert resolve_processes(DistillConfig(batch_size=6, strategy="ddp"), env={}, cuda_devices=4) == 4
    assert distill_runner(DistillConfig(processes=1)) is run_distill
    assert distill_runner(DistillConfig(processes=2, strategy="ddp")) is run_distill_distributed


def test_process_fields_are_validated_and_do_not_change_the_training_identity():
    with pytest.raises(ValidationError, match=r"distill.batch_size=2 is smaller than the 3 training processes"):
        DistillConfig(processes=3, batch_size=2)
    with pytest.raises(ValidationError, match=r"distill.offload_optimizer=cpu needs distill.strategy: deepspeed-zero3"):
        DistillConfig(strategy="ddp", offload_optimizer="cpu")
    with pytest.raises(ValidationError):
        DistillConfig(processes=0)
    base = DistillConfig(batch_size=8)
    spread = DistillConfig(batch_size=8, processes=4, strategy="ddp")
    zero = DistillConfig(batch_size=8, processes=2, offload_optimizer="nvme", offload_param="cpu", deepspeed_config="x.json")
    assert base.training_identity() == spread.training_identity() == zero.training_identity()
    assert DistillConfig(batch_size=4).training_identity() != base.training_identity()


def test_zero3_config_is_the_shipped_file_with_batch_offload_and_precision_filled_in(tmp_path):
    shipped = SHIPPED_ZERO3.read_text()
    cfg = DistillConfig(batch_size=8, offload_optimizer="cpu")
    ds = zero_config(cfg, 4, bf16=True)
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is True and ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and ds["zero_optimization"]["offload_param"]["device"] == "none"
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (8, 2, 1)
    assert ds["zero_allow_untested_optimizer"] is True and ds["zero_force_ds_cpu_optimizer"] is False
    assert "optimizer" not in ds and "scheduler" not in ds and "fp16" not in ds
    assert zero_config(cfg, 2, bf16=False)["bf16"]["enabled"] is False  # a CPU run is fp32
    assert zero_config(cfg, 2, bf16=False)["train_micro_batch_size_per_gpu"] == 4
    assert SHIPPED_ZERO3.read_text() == shipped  # rendered, never written back

    with pytest.raises(ValueError, match=r"distill.offload_param=nvme needs zero_optimization.offload_param.nvme_path"):
        zero_config(DistillConfig(batch_size=8, offload_param="nvme"), 2, bf16=True)
    custom = json.loads(shipped)
    custom["zero_optimization"]["offload_param"]["nvme_path"] = "/local_nvme"
    (tmp_path / "nvme.json").write_text(json.dumps(custom))
    ds = zero_config(DistillConfig(batch_size=8, offload_param="nvme", deepspeed_config=str(tmp_path / "nvme.json")), 2, bf16=True)
    assert ds["zero_optimization"]["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/local_nvme"}
    for change, message in [({"optimizer": {"type": "Adam"}}, "has an `optimizer` block"),
                            ({"zero_optimization": {"stage": 2}}, r"zero_optimization.stage=2; strategy deepspeed-zero3 runs stage 3"),
                            ({"gradient_clipping": 0.5}, "gradient_clipping=0.5"),
                            ({"fp16": {"enabled": True}}, "enables fp16")]:
        (tmp_path / "bad.json").write_text(json.dumps(json.loads(shipped) | change))
        with pytest.raises(ValueError, match=message):
            zero_config(DistillConfig(deepspeed_config=str(tmp_path / "bad.json")), 2, bf16=True)
    with pytest.raises(ValueError, match=r"distill.deepspeed_config=missing.json: no such file"):
        zero_config(DistillConfig(deepspeed_config="missing.json"), 2, bf16=True)


# --------------------------------------------------------------------------------------- real launches


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, teacher_dir) -> tuple[Path, Path, Path]:
    """(teacher, student config, corpus): a random 4-layer Llama with SmolLM2's whole tokenizer and vocabulary (so
    run_distill's checks pass on it), a narrower 1-layer student config (the hidden term goes through a projection),
    and texts of 3 to 40 words."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("dist")
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    torch.manual_seed(0)
    common = dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, **common)).save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, **common).save_pretrained(root / "student")
    tok.save_pretrained(root / "student")
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree near water".split()
    texts = [" ".join(words[(3 * i) % 11 : (3 * i) % 11 + 3 + (7 * i) % 13]) for i in range(12)]
    return root / "teacher", root / "student", _jsonl(root / "corpus.jsonl", texts)


@pytest.fixture(scope="module")
def one_process(tiny_pair, tmp_path_factory) -> tuple[dict, Path]:
    """The reference: the run in this process (processes=1, plain torch)."""
    return _one_process_run(tiny_pair, RUN, tmp_path_factory.mktemp("one"))


def _one_process_run(tiny_pair, run: dict, root: Path) -> tuple[dict, Path]:
    """(metrics, student dir) of the tiny pair's run with `run`'s settings in this process, on one thread."""
    teacher, student_cfg, corpus = tiny_pair
    cfg = DistillConfig(student_from=str(student_cfg), processes=1, **run)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.warns(UserWarning, match="parameter ratio"):
            metrics = run_distill(teacher, cfg, [corpus], EVAL, root / "student", root / "work", student_from=student_cfg)
    finally:
        torch.set_num_threads(before)
    return metrics, root / "student"


def _weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(d / "model.safetensors")


def _assert_same_training(got: dict, want: dict, rel: float, steps: int = RUN["steps"]) -> None:
    assert [h["step"] for h in got["history"]] == [h["step"] for h in want["history"]] == list(range(steps))
    for g, w in zip(got["history"], want["history"]):
        for term in ("total", "kd", "ce", "hidden_mse"):
            assert g[term] == pytest.approx(w[term], rel=rel), (g["step"], term, g[term], w[term])
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-12)
    assert got["training_tokens"] == want["training_tokens"] and got["training_sequences"] == want["training_sequences"]


def test_two_processes_train_as_one(tiny_pair, one_process, tmp_path, monkeypatch, capfd):
    """Acceptance: 2 processes launched by the real torchrun (DDP over gloo) give the 1-process loss trajectory and
    weights, with the same global batch of different-length sequences; rank 0 logs each step to MLflow."""
    from mlflow import MlflowClient

    teacher, student_cfg, corpus = tiny_pair
    want, want_dir = one_process
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store: no server to boot for one run
    client = MlflowClient(f"file://{tmp_path / 'mlruns'}")
    run_id = client.create_run(client.create_experiment("dist")).info.run_id
    cfg = DistillConfig(student_from=str(student_cfg), processes=2, strategy="ddp", **RUN)
    got = run_distill_distributed(teacher, cfg, [corpus], EVAL, tmp_path / "student", tmp_path / "work",
                                  student_from=student_cfg, log=mlflow_step_logger(client, run_id))
    assert got["training_processes"] == 2 and want["training_processes"] == 1
    _assert_same_training(got, want, rel=1e-4)
    diffs = {k: float((v - _weights(want_dir)[k]).abs().max()) for k, v in _weights(tmp_path / "student").items()}
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    for k in ("student_top1_vs_teacher", "student_kl_vs_teacher", "student_ppl", "student_ppl_before_training"):
        assert got[k] == pytest.approx(want[k], rel=1e-4), k
    assert got["dataset_cache_hit"] == 0  # built once by the launcher, found cached by both processes
    # rank 0 logged every step's terms (the whole step's values) to the caller's run as it trained
    logged = client.get_metric_history(run_id, "total")
    assert [m.step for m in logged] == [0, 1, 2, 3]
    assert [m.value for m in logged] == pytest.approx([h["total"] for h in got["history"]], rel=1e-9)
    assert client.get_run(run_id).data.metrics["dataset_cache_hit"] == 0
    # the step-2 checkpoint (rank 0's) was removed with the rest once the student was saved
    assert not any((tmp_path / "work" / "checkpoints" / "distill").iterdir())
    assert "distill-launch-" not in " ".join(p.name for p in (tmp_path / "work").iterdir())
    with capfd.disabled():
        print("\n1-process totals:", [round(h["total"], 6) for h in want["history"]])
        print("2-process totals:", [round(h["total"], 6) for h in got["history"]], "max weight diff", max(diffs.values()))


@pytest.mark.deepspeed
def test_deepspeed_zero3_on_two_cpu_processes_trains_as_one(tiny_pair, one_process, tmp_path, monkeypatch, capfd):
    """strategy deepspeed-zero3 on this CPU (DS_ACCELERATOR=cpu, gloo, fp32): the same trajectory as one process. The
    first run compiles DeepSpeed's CPU communication op (~150 s) into TORCH_EXTENSIONS_DIR; later runs reuse it."""
    require_deepspeed()
    teacher, student_cfg, corpus = tiny_pair
    want, want_dir = one_process
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # the launcher picks the CPU accelerator itself
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)  # and keeps compiled ops in edgeflow's cache
    cfg = DistillConfig(student_from=str(student_cfg), processes=2, strategy="deepspeed-zero3", **RUN)
    logged: list[tuple[int, dict]] = []
    got = run_distill_distributed(teacher, cfg, [corpus], EVAL, tmp_path / "student", tmp_path / "work",
                                  student_from=student_cfg, log=lambda s, m: logged.append((s, m)))
    assert got["training_processes"] == 2
    _assert_same_training(got, want, rel=1e-4)
    diffs = {k: float((v - _weights(want_dir)[k]).abs().max()) for k, v in _weights(tmp_path / "student").items()}
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    # a callback that is not an MLflow logger receives rank 0's calls once the run is over
    assert [s for s, m in logged if "total" in m] == [0, 1, 2, 3]
    # DeepSpeed's CPU communication op was compiled (or found) in the user's cache, outside the checkout
    assert (user_cache() / "torch_extensions" / "deepspeed_shm_comm").is_dir()
    with capfd.disabled():
        print("\n1-process totals:", [round(h["total"], 6) for h in want["history"]])
        print("ZeRO-3 2-process totals:", [round(h["total"], 6) for h in got["history"]], "max weight diff", max(diffs.values()))


@pytest.mark.deepspeed
def test_a_killed_zero3_run_resumes_from_its_zero_checkpoint_and_trains_as_one(tiny_pair, tmp_path):
    """Every process of a ZeRO-3 run (torchrun and both ranks) is SIGKILLed once a checkpoint exists; the same call
    again resumes from that checkpoint's sharded engine state and ends where the uninterrupted one-process run ends:
    the same loss at every step and the same weights, at the tolerance the DDP and ZeRO-3 runs above are held to."""
    import signal
    import subprocess
    import sys
    import time

    require_deepspeed()
    teacher, student_cfg, corpus = tiny_pair
    run = RUN | {"steps": KILL_STEPS}
    want = _one_process_run(tiny_pair, run, tmp_path / "one")
    spec = {"teacher": str(teacher), "student_from": str(student_cfg), "corpus": str(corpus), "eval_texts": EVAL,
            "cfg": {"student_from": str(student_cfg), "processes": 2, "strategy": "deepspeed-zero3", **run},
            "out": str(tmp_path / "student"), "work": str(tmp_path / "work"), "result": str(tmp_path / "result.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "tests.helpers.distill_launch", str(tmp_path / "spec.json")]
    checkpoints = tmp_path / "work" / "checkpoints" / "distill"
    with (tmp_path / "killed.log").open("w") as out:
        victim = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while victim.poll() is None and time.monotonic() < deadline and not _complete_checkpoints(checkpoints):
            time.sleep(0.02)
    finally:
        os.killpg(victim.pid, signal.SIGKILL)  # the launcher, torchrun and both ranks: one session
        victim.wait()
    log = (tmp_path / "killed.log").read_text()
    assert victim.returncode == -signal.SIGKILL, f"the run ended before a checkpoint was killed ({victim.returncode}):\n{log[-3000:]}"
    killed_at = max(_complete_checkpoints(checkpoints))
    # torchrun starts each process in a session of its own: they end with it (launch.die_with_launcher), not later;
    # orphans would train on and write the next checkpoints (every 2 steps) until they next printed to a closed pipe
    time.sleep(5)
    assert not _processes_of(tmp_path / "work"), [p.info["cmdline"] for p in _processes_of(tmp_path / "work")]
    assert max(_complete_checkpoints(checkpoints)) == killed_at
    assert 0 < killed_at < KILL_STEPS and not (tmp_path / "student").exists(), (killed_at, log[-2000:])
    shards = sorted(p.name for p in (checkpoints.glob(f"*/step-{killed_at:08d}/engine/*")))
    assert any("zero_pp_rank_1" in s for s in shards), shards  # rank 1's own optimizer shard is in the checkpoint

    subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["resumed_from_step"] == killed_at and got["training_processes"] == 2
    _assert_same_training(got, want[0], rel=1e-4, steps=KILL_STEPS)
    diffs = {k: float((v - _weights(want[1])[k]).abs().max()) for k, v in _weights(tmp_path / "student").items()}
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    assert not any(checkpoints.iterdir())  # the finished run removed its checkpoints


def _processes_of(work: Path) -> list:
    """The live processes whose command line names a file under `work` (the ranks read their spec from there)."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if any(str(work) in a for a in (p.info["cmdline"] or []))]


def _complete_checkpoints(root: Path) -> list[int]:
    """The steps of the checkpoints under root that were renamed into place (no .tmp: written whole)."""
    return [int(d.name.removeprefix("step-")) for d in root.glob("*/step-*") if not d.name.endswith(".tmp")]


def test_deepspeed_strategy_without_deepspeed_fails_before_any_compute(tiny_pair, tmp_path, monkeypatch):
    teacher, student_cfg, corpus = tiny_pair
    if importlib.util.find_spec("deepspeed") is not None:  # installed here: make this run see it missing
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    cfg = DistillConfig(student_from=str(student_cfg), processes=2, **RUN)
    assert cfg.strategy == "deepspeed-zero3"  # the default
    work = tmp_path / "work"
    with pytest.raises(RuntimeError) as e:
        run_distill_distributed(teacher, cfg, [corpus], EVAL, tmp_path / "student", work, student_from=student_cfg)
    msg = str(e.value)
    assert "distill.strategy=deepspeed-zero3 with 2 processes needs DeepSpeed" in msg, msg
    assert "install the `gpu` extra" in msg.lower() and "set distill.strategy: ddp" in msg
    assert not work.exists()  # refused before the training set was built or any process started


# torchrun's report when a process dies without a Python exception (here rank 0, killed; rank 1 then stopped by it)
TORCHRUN_SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
edgeflow.distill.launch FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 11152)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 11151)
============================================================
"""


def test_a_failed_process_is_reported_with_its_rank_and_error(tmp_path, monkeypatch):
    """main() records the exception of the process it runs in for the launcher, whose error names the rank that
    failed first and its exception; without one (killed by a signal) it quotes torchrun's root cause."""
    from collections import deque

    from edgeflow.distill.launch import failure_message, main

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cfg": {"batch_size": 0}, "errors": str(tmp_path / "errors")}))
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValidationError):
        main(["--spec", str(spec)])
    ddp = DistillConfig(strategy="ddp")
    msg = failure_message(1, 2, ddp, tmp_path / "errors", deque(["last output line\n"]))
    assert msg.startswith("distributed distillation failed: rank 1 failed first: ValidationError: "), msg
    assert "batch_size" in msg and "torchrun exited 1 (2 processes, distill.strategy=ddp)" in msg and msg.endswith("last output line\n")
    msg = failure_message(1, 2, ddp, tmp_path / "none", deque(TORCHRUN_SUMMARY.splitlines(keepends=True)))
    assert "distributed distillation failed: rank 0 exited with code -9 (a signal: -9 is SIGKILL" in msg, msg
