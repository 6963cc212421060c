"""Multi-process distillation: the training loop of edgeflow/distill/train.py spread over several processes, one per GPU.

run_distill_distributed has run_distill's signature and result. It checks what needs no compute (process count,
strategy, batch split, tokenizers), builds the training set once, writes a spec and launches

    python -m torch.distributed.run --standalone --nproc_per_node N -m edgeflow.distill.launch --spec SPEC

(torchrun, as a module of the running interpreter). Every process runs main(): it joins the process group (NCCL on
CUDA, gloo on a CPU), loads the models as run_distill does and trains on its share of each step, under
DistributedDataParallel (strategy ddp) or a DeepSpeed ZeRO-3 engine (strategy deepspeed-zero3, config from
distill.deepspeed_config). Rank 0 evaluates and saves the student, logs per-step metrics to MLflow when the caller
logs to an MLflow run, and writes the result the caller returns.

On a CPU the same code runs with gloo: tests/distill/test_distill_distributed.py launches 2 processes.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from edgeflow.paths import REPO_ROOT, user_cache
from edgeflow.profile import DistillConfig
from edgeflow.distill import (LogFn, compare_to_teacher, finish_run, load_tokenizer, prepare_dataset, prepare_run, run_distill,
                           teacher_logits, train)
from edgeflow.tracking.runs import MlflowStepLogger

# Output lines of a failed launch quoted in its error.
ERROR_TAIL_LINES = 40


def visible_cuda_devices() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_processes(cfg: DistillConfig, env: Mapping[str, str] | None = None, cuda_devices: int | None = None) -> int:
    """How many training processes: distill.processes, else EDGEFLOW_GPUS (the a100 job's GPU count) when CUDA is
    available, else the visible CUDA devices, else 1. Raises naming the source when the batch cannot be split or the
    GPUs are not there."""
    env = os.environ if env is None else env
    cuda = visible_cuda_devices() if cuda_devices is None else cuda_devices
    if cfg.processes is not None:
        n, source = cfg.processes, f"distill.processes={cfg.processes}"
    elif cuda and env.get("EDGEFLOW_GPUS"):
        raw = env["EDGEFLOW_GPUS"]
        n = int(raw) if raw.strip().isdigit() else 0
        if n < 1:
            raise ValueError(f"EDGEFLOW_GPUS={raw!r} is not a GPU count of 1 or more; the a100 job sets it from its gpu_count. "
                             "Fix or unset it, or set distill.processes")
        source = f"EDGEFLOW_GPUS={n}"
    else:
        n, source = max(cuda, 1), f"the {cuda} visible CUDA device(s)"
    if cuda and n > cuda:
        raise ValueError(f"{source} asks for {n} training processes, one per GPU, but only {cuda} CUDA device(s) are visible; "
                         "lower it or give the job more GPUs")
    cfg.check_processes(n)
    return n


def check_strategy(cfg: DistillConfig, processes: int) -> None:
    """Refuse, before any compute, a DeepSpeed run where DeepSpeed is not installed."""
    if processes > 1 and cfg.strategy == "deepspeed-zero3" and importlib.util.find_spec("deepspeed") is None:
        raise RuntimeError(
            f"distill.strategy=deepspeed-zero3 with {processes} processes needs DeepSpeed, which is not installed in {sys.prefix}. "
            "Install the `gpu` extra (pip install -e '.[gpu]', deepspeed==0.19.8) or set distill.strategy: ddp"
        )


def zero_config(cfg: DistillConfig, processes: int, bf16: bool) -> dict:
    """The DeepSpeed config of this run: distill.deepspeed_config with batch sizes, offload devices and precision filled in.

    bf16=False (a CPU run) turns the file's bf16 off: the run is then fp32, comparable with a one-process run.
    """
    path = Path(cfg.deepspeed_config)
    path = path if path.is_absolute() else REPO_ROOT / path
    field = f"distill.deepspeed_config={cfg.deepspeed_config}"
    try:
        ds = copy.deepcopy(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ValueError(f"{field}: no such file ({path}); paths are relative to the repository root "
                         "(the shipped one is deployments/deepspeed/zero3-bf16.json)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{field} is not valid JSON ({e}); DeepSpeed configs are plain JSON without comments") from None
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(f"{field} has an `{key}` block; remove it: training passes its own torch AdamW and warmup "
                             "schedule, the same on every strategy")
    if ds.get("fp16", {}).get("enabled"):
        raise ValueError(f"{field} enables fp16, which needs loss scaling the training loop does not do; use bf16")
    zero = ds.setdefault("zero_optimization", {})
    if zero.setdefault("stage", 3) != 3:
        raise ValueError(f"{field} sets zero_optimization.stage={zero['stage']}; strategy deepspeed-zero3 runs stage 3: "
                         "set it to 3, or use distill.strategy: ddp")
    if ds.setdefault("gradient_clipping", 1.0) != 1.0:
        raise ValueError(f"{field} sets gradient_clipping={ds['gradient_clipping']}; every training path clips the gradient "
                         "norm at 1.0 (same training whatever the strategy): set it to 1.0")
    for name in ("offload_optimizer", "offload_param"):
        device = getattr(cfg, f"{name}")
        block = zero.setdefault(name, {})
        block["device"] = device
        if device == "nvme" and not block.get("nvme_path"):
            raise ValueError(f"distill.{name}=nvme needs zero_optimization.{name}.nvme_path (a local NVMe directory) in "
                             f"{cfg.deepspeed_config}; add it or offload to cpu")
    ds["train_batch_size"] = cfg.batch_size
    ds["train_micro_batch_size_per_gpu"] = cfg.batch_size // processes
    ds["gradient_accumulation_steps"] = 1
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": bool(ds.get("bf16", {}).get("enabled")) and bf16}
    # torch AdamW rather than DeepSpeed's fused/CPU Adam: the same optimizer as the other paths, and nothing to compile.
    ds["zero_allow_untested_optimizer"] = True
    # with offload_optimizer, DeepSpeed otherwise insists on its compiled CPU Adam (faster there, compiled on first use)
    ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def launch_command(nproc: int, spec_path: Path) -> list[str]:
    """torchrun (as a module of this interpreter, so the processes use the same environment) running main() nproc times."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "edgeflow.distill.launch", "--spec", str(spec_path)]


def distill_runner(cfg: DistillConfig) -> Callable[..., dict]:
    """run_distill (this process, plain torch) or run_distill_distributed, by the resolved process count."""
    return run_distill_distributed if resolve_processes(cfg) > 1 else run_distill


def run_distill_distributed(teacher_dir: Path, cfg: DistillConfig, corpora: list[Path], eval_texts: list[str], out_dir: Path,
                            work_dir: Path, student_from: Path | None = None, log: LogFn | None = None,
                            teacher_sha256: str | None = None) -> dict:
    """run_distill over resolve_processes(cfg) processes launched by torchrun; the same metrics, the student in out_dir.

    An MLflowStepLogger `log` is handed to rank 0, which logs each step as it happens; any other callback receives
    rank 0's calls once the run has finished. With one process this is run_distill.
    """
    n = resolve_processes(cfg)
    if n == 1:
        return run_distill(teacher_dir, cfg, corpora, eval_texts, out_dir, work_dir, student_from, log, teacher_sha256)
    check_strategy(cfg, n)
    cuda = visible_cuda_devices() > 0
    zero = zero_config(cfg, n, bf16=cuda) if cfg.strategy == "deepspeed-zero3" else None
    # Before any process starts: the tokenizer check and the training set, built once here (every process then finds it
    # in the cache instead of building it N times at once).
    tokenizer = load_tokenizer(teacher_dir, student_from)
    _, data_stats = prepare_dataset(corpora, tokenizer, cfg, work_dir / "cache" / "distill-data")
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="distill-launch-", dir=work_dir) as tmp:
        d = Path(tmp)
        mlflow = {"tracking_uri": log.tracking_uri, "run_id": log.run_id} if isinstance(log, MlflowStepLogger) else None
        spec = {
            # only the fields the caller set: re-validated in each process, defaults would count as set (keep_every_k)
            "teacher_dir": str(teacher_dir), "cfg": cfg.model_dump(mode="json", exclude_unset=True), "corpora": [str(c) for c in corpora],
            "eval_texts": list(eval_texts), "out_dir": str(out_dir), "work_dir": str(work_dir),
            "student_from": str(student_from) if student_from is not None else None, "zero_config": zero,
            "mlflow": mlflow, "events": str(d / "events.jsonl") if log is not None and mlflow is None else None,
            "result": str(d / "result.json"), "errors": str(d / "errors"),
            "dataset_cache_hit": data_stats["dataset_cache_hit"], "teacher_sha256": teacher_sha256,
        }
        (d / "spec.json").write_text(json.dumps(spec))
        env = os.environ.copy()
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if zero is not None:
            if not cuda:
                env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise look for an accelerator to drive
            # DeepSpeed compiles ops on first use (its CPU communication op: ~100-150 s on 2 cores) into torch's
            # extension dir, by default under /tmp, which a reboot or a fresh container loses: keep them with the
            # user's other caches, so only a machine's first ZeRO run pays for it (BENCHMARKS.md#deepspeed-zero-3).
            env.setdefault("TORCH_EXTENSIONS_DIR", str(user_cache() / "torch_extensions"))
        rc, tail = _stream(launch_command(n, d / "spec.json"), env)
        if rc != 0:
            raise RuntimeError(failure_message(rc, n, cfg, d / "errors", tail))
        result_file = d / "result.json"
        if not result_file.exists():
            raise RuntimeError(f"distributed distillation exited 0 but rank 0 wrote no result ({result_file}); output tail:\n{''.join(tail)}")
        result = json.loads(result_file.read_text())
        if spec["events"] and Path(spec["events"]).exists():
            for line in Path(spec["events"]).read_text().splitlines():
                step, metrics = json.loads(line)
                log(step, metrics)
    return result


def _stream(cmd: list[str], env: dict[str, str]) -> tuple[int, deque[str]]:
    """Run cmd from the repository root, echoing its output line by line; (exit code, last output lines)."""
    tail: deque[str] = deque(maxlen=ERROR_TAIL_LINES)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)  # print, not sys.stdout: Prefect's log_prints records it
            tail.append(line)
        return proc.wait(), tail
    finally:
        if proc.poll() is None:  # interrupted while streaming: torchrun passes SIGTERM on to its processes
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def failure_message(rc: int, n: int, cfg: DistillConfig, errors: Path, tail: deque[str]) -> str:
    """The error of a failed launch: the rank that failed first and its exception (recorded by main()), else the rank
    and exit code of torchrun's own summary."""
    reports = sorted(errors.glob("rank-*.txt"), key=lambda p: p.stat().st_mtime) if errors.exists() else []
    if reports:
        first = reports[0]
        cause = f"rank {first.stem.split('-')[1]} failed first: {first.read_text().strip()}"
        others = [p.stem.split("-")[1] for p in reports[1:]]
        if others:
            cause += f" (then rank(s) {', '.join(others)})"
    else:
        # no exception recorded (killed by a signal, e.g. out of memory): torchrun's summary names rank and exit code;
        # its "Failures" section lists the processes it stopped afterwards, "Root Cause" the first one to fail
        text = "".join(tail).split("Root Cause", 1)[-1]
        ranks = re.findall(r"rank\s*:\s*(\d+)", text)
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", text)
        cause = (f"rank {ranks[0]} exited with code {codes[0]}" + (" (a signal: -9 is SIGKILL, often the out-of-memory killer)"
                 if codes[0].startswith("-") else "")) if ranks and codes else "no process reported an exception"
    return (f"distributed distillation failed: {cause}. torchrun exited {rc} ({n} processes, distill.strategy={cfg.strategy}). "
            f"Last {len(tail)} output lines:\n{''.join(tail)}")


def _rank0_log(spec: dict) -> LogFn | None:
    """Rank 0's log callback: to the caller's MLflow run as each step happens, or to the events file the caller replays."""
    sinks: list[LogFn] = []
    if spec["mlflow"]:
        from mlflow import MlflowClient

        sinks.append(MlflowStepLogger(MlflowClient(spec["mlflow"]["tracking_uri"]), spec["mlflow"]["run_id"]))
    if spec["events"]:
        events = Path(spec["events"])

        def to_file(step: int, metrics: dict[str, float]) -> None:
            with events.open("a") as f:
                f.write(json.dumps([step, metrics]) + "\n")

        sinks.append(to_file)
    if not sinks:
        return None

    def log(step: int, metrics: dict[str, float]) -> None:
        if "dataset_cache_hit" in metrics:  # the launcher built the set; this process only found it cached
            metrics = metrics | {"dataset_cache_hit": spec["dataset_cache_hit"]}
        for sink in sinks:
            sink(step, metrics)

    return log


def _run_process(spec: dict) -> None:
    """One process of the run: join the group, prepare as run_distill does, train on this rank's share; rank 0 finishes."""
    import torch.distributed as dist

    cfg = DistillConfig.model_validate(spec["cfg"])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # A collective that waits longer than the stall timeout is a hang; the margin covers what rank 0 does alone while
    # the others wait in one (held-out evaluation before training, writing a checkpoint).
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.stall_timeout_s + 600))
    try:
        student_from = Path(spec["student_from"]) if spec["student_from"] else None
        log = _rank0_log(spec) if rank == 0 else None
        run = prepare_run(Path(spec["teacher_dir"]), cfg, [Path(c) for c in spec["corpora"]], spec["eval_texts"],
                          Path(spec["work_dir"]), student_from, log, spec["teacher_sha256"])
        run.teacher.to(device)
        run.student.to(device)
        teacher_out = teacher_logits(run.teacher, run.held_out) if rank == 0 else None
        before = compare_to_teacher(run.teacher, run.student, run.held_out, teacher_out) if rank == 0 else {}
        result = train(run.teacher, run.student, run.data, cfg, run.tokenizer.pad_token_id, layer_map=run.layer_map,
                       checkpoint_dir=run.checkpoint_dir, run_label=run.run_key[:12], log=log, zero_config=spec["zero_config"],
                       teacher_cache=run.teacher_cache)
        if rank == 0:
            metrics = finish_run(run, before, result, Path(spec["out_dir"]), teacher_out) | {"dataset_cache_hit": spec["dataset_cache_hit"]}
            out = Path(spec["result"])
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(json.dumps(metrics))
            tmp.rename(out)
    finally:
        dist.destroy_process_group()


# prctl(2) option: the signal the kernel sends this process when its parent exits.
PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """End this process when torchrun, its parent, ends. torchrun starts every process in a session of its own
    (torch.distributed.elastic's subprocess handler), so killing the launcher's process group, as a worker cancelling
    the stage or an operator's SIGKILL does, left the processes training on as orphans: here they ran 36 more steps
    and wrote a checkpoint after the launcher was gone, and on a GPU host they would hold its memory against the
    retry. Linux only (prctl); elsewhere nothing changes."""
    import ctypes
    import signal

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    """Entry point of every process torchrun starts; an exception is recorded for the launcher, then re-raised."""
    parser = argparse.ArgumentParser(description="One process of a multi-process distillation (started by torchrun).")
    parser.add_argument("--spec", type=Path, required=True, help="JSON written by run_distill_distributed")
    spec = json.loads(parser.parse_args(argv).spec.read_text())
    die_with_launcher()
    try:
        _run_process(spec)
    except BaseException as e:
        errors = Path(spec["errors"])
        errors.mkdir(parents=True, exist_ok=True)
        (errors / f"rank-{os.environ.get('RANK', '?')}.txt").write_text(f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    main()
