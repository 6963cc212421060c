"""Resumable training state: where a run's checkpoints live (distill_run_key, checkpoint_root: keyed by the content hash
of the run's inputs, so a retried Prefect run finds them), writing one step's state atomically and finding the newest
complete one (save_checkpoint, latest_checkpoint, find_checkpoint), refusing a checkpoint written by another kind of
run (load_checkpoint), and every process's RNG stream (rng_state, gather_rng, rank_rng, set_rng_state).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from edgeflow.tracking.artifacts import MANIFEST, sha256_file, sha256_json, sha256_tree
from edgeflow.profile import DistillConfig

def _tree_identity(d: Path) -> str:
    """Content hash of a model directory: its edgeflow manifest when present (written once, immutable), else the files."""
    return sha256_file(d / MANIFEST) if (d / MANIFEST).exists() else sha256_tree(d)


def distill_run_key(teacher_dir: Path, student_from: Path | None, cfg: DistillConfig, data_key: str) -> str:
    """Content hash of one training run's inputs: the same teacher, student source, training fields and data give
    the same key (a retried Prefect run finds its checkpoints); telemetry and checkpoint cadence do not count."""
    return sha256_json({"teacher": _tree_identity(teacher_dir), "student_from": student_from and _tree_identity(student_from),
                        "cfg": cfg.training_identity(), "data": data_key})


def checkpoint_root(work_dir: Path, run_key: str) -> Path:
    """Where a run's resumable checkpoints live: keyed by its content hash, so a retry of the same inputs finds them."""
    return work_dir / "checkpoints" / "distill" / run_key[:24]


_STEP_DIR = re.compile(r"^step-(\d{8})$")


def save_checkpoint(root: Path, step: int, state: dict, *, started: bool = False) -> Path:
    """Write `state` as root/step-<step>/ atomically (tmp dir, fsync, rename) and drop older checkpoints.

    started=True: root/step-<step>.tmp already holds files every process wrote (a DeepSpeed engine's shards); keep them.
    """
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step:08d}", root / f"step-{step:08d}.tmp"
    if not started:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    (tmp / "meta.json").write_text(json.dumps({"step": step, "written": time.time()}))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)  # a crash before this line leaves only a .tmp dir, which resuming ignores
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in root.iterdir():
        if old != final and _STEP_DIR.match(old.name):
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """(step, state file) of the newest complete checkpoint under root; half-written .tmp dirs are removed."""
    if not root.exists():
        return None
    found = []
    for d in root.iterdir():
        if d.name.endswith(".tmp"):
            shutil.rmtree(d, ignore_errors=True)
        elif (m := _STEP_DIR.match(d.name)) and (d / "state.pt").exists():
            found.append((int(m.group(1)), d / "state.pt"))
    return max(found) if found else None


def rng_state() -> dict:
    """This process's torch, CUDA (this device), Python and numpy RNG states."""
    return {
        "torch": torch.get_rng_state(),
        # this process's device only: in a multi-GPU run, reading every device's state would open a CUDA context
        # (hundreds of MiB) on every GPU from every process
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(s: dict) -> None:
    """Restore an RNG state written by rng_state (a checkpoint's)."""
    torch.set_rng_state(s["torch"])
    cuda = s.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # written when checkpoints held every device's state
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda)
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])


def rank_rng(state: dict, rank: int, world: int) -> dict:
    """The RNG state this process resumes with: its own when the checkpoint was written by as many processes."""
    ranks = state.get("rng_ranks")
    if ranks and len(ranks) == world:
        return ranks[rank]
    # another process count: every process continues rank 0's stream (it only feeds dropout, if any)
    return state["rng"]



def find_checkpoint(checkpoint_dir: Path | None, rank: int, world: int) -> tuple[int, Path] | None:
    """The newest checkpoint, as rank 0 found it: every process resumes from the same one."""
    found = latest_checkpoint(checkpoint_dir) if checkpoint_dir and rank == 0 else None
    if world > 1 and checkpoint_dir:
        import torch.distributed as dist

        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    return found


def load_checkpoint(state_file: Path, checkpoint_dir: Path, device: torch.device, samples: int, batch_size: int,
                    engine_format: str, world: int) -> dict:
    """The state saved in state_file; raises naming the fix when it was written for another training set or batch
    size, by another strategy, or (ZeRO shards) by another process count."""
    # our own file under the profile's work dir; it holds RNG tuples and numpy arrays, hence weights_only=False
    state = torch.load(state_file, map_location=device, weights_only=False)
    if state["data"]["samples"] != samples or state["data"]["batch_size"] != batch_size:
        raise RuntimeError(f"checkpoint {state_file} was written for another training set or batch size; delete {checkpoint_dir}")
    # a torch checkpoint holds whole tensors (any process count resumes it); a ZeRO one holds one shard per process
    written_by = state.get("engine", {"format": "torch", "world_size": 1})
    if written_by["format"] != engine_format or (engine_format == "deepspeed" and written_by["world_size"] != world):
        names = {"torch": "plain torch (one process or ddp)", "deepspeed": "deepspeed-zero3"}
        raise RuntimeError(
            f"checkpoint {state_file} was written by a {names[written_by['format']]} run of {written_by['world_size']} "
            f"process(es); this run is {names[engine_format]} with {world}. Resume it with the distill.strategy and "
            f"distill.processes it was written with, or delete {checkpoint_dir} to start over"
        )
    return state


def gather_rng(world: int) -> list[dict]:
    """Every process's RNG state (collective), so each resumes its own stream."""
    if world == 1:
        return [rng_state()]
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, rng_state())
    return out
