"""The distillation loop, train(), read top to bottom: setup (checks, the student and its projections as one trained
module, the optimizer engine, resuming the newest checkpoint) -> one optimizer step per batch (frozen teacher and
student forward, the loss terms of edgeflow/distill/losses.py as sums over the whole step, backward, step, logged terms, gauges,
checkpoints) -> the student trained in place, back in eval mode.

The same loop runs in every process of a multi-process run (edgeflow/distill/launch.py), each on its share of a step,
under DistributedDataParallel (_TorchEngine) or a DeepSpeed ZeRO-3 engine (_ZeroEngine).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from edgeflow.profile import DistillConfig
from edgeflow.distill.checkpoints import find_checkpoint, gather_rng, load_checkpoint, rank_rng, save_checkpoint, set_rng_state
from edgeflow.distill.checks import check_no_shared_storage, check_teacher_frozen
from edgeflow.distill.data import BatchOrder, TokenDataset, collate
from edgeflow.distill.student import count_params
from edgeflow.distill.teacher_cache import TeacherCache
from edgeflow.distill.telemetry import GaugePusher, StallWatchdog
from edgeflow.engines.cpu_host import cpu_flags
from edgeflow.distill.losses import StepSums, hidden_sums, kd_sums, kd_sums_topk, make_projections, rank_share
from edgeflow.tracking.progress import LoopProgress

logger = logging.getLogger("edgeflow.distill")

LogFn = Callable[[int, dict[str, float]], None]


@dataclass
class DistillResult:
    """What the training loop measured."""

    steps: int
    final_loss: float
    history: list[dict[str, float]]
    tokens_per_s: float
    teacher_params: int
    student_params: int
    resumed_from_step: int = 0
    checkpoints_written: list[int] = field(default_factory=list)
    processes: int = 1
    teacher_cache: dict[str, float] = field(default_factory=dict)


def _hidden(outputs, layers: list[int]) -> list[torch.Tensor]:
    # hidden_states[0] is the embedding output; hidden_states[i + 1] is decoder layer i's output
    return [outputs.hidden_states[i + 1] for i in layers]


def _rank_world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) unless a torch.distributed process group is initialized."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    """`t` summed over every process (t itself in a single process)."""
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class _Trainee(torch.nn.Module):
    """What the optimizer updates, as one module: the student and the projections its mapped hidden states go through.

    One module, called once per step, is what DistributedDataParallel (gradient all-reduce) and ZeRO-3 (gathering a
    weight before the submodule that uses it runs) need to see every trained weight.
    """

    def __init__(self, student, projections: torch.nn.ModuleDict, s_layers: list[int]):
        super().__init__()
        self.student, self.projections, self.s_layers = student, projections, s_layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, with_hidden: bool):
        out = self.student(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=with_hidden, use_cache=False)
        if not with_hidden:
            return out.logits, []
        hidden = _hidden(out, self.s_layers)
        return out.logits, [self.projections[str(j)](h) if str(j) in self.projections else h for j, h in zip(self.s_layers, hidden)]


def _warmup(cfg: DistillConfig) -> Callable[[int], float]:
    warmup = max(1, cfg.steps // 10)
    return lambda s: min(1.0, (s + 1) / warmup)


class _TorchEngine:
    """One process, or DistributedDataParallel: every process holds the whole student and AdamW state (fp32)."""

    format = "torch"

    def __init__(self, trainee: _Trainee, cfg: DistillConfig, world: int, device: torch.device):
        self.trainee = trainee
        self.params = [p for p in trainee.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _warmup(cfg))
        self.module = trainee
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            # buffers (rotary frequencies) are constants here: synced once at init, not before every step
            self.module = DistributedDataParallel(trainee, device_ids=[device.index] if device.type == "cuda" else None,
                                                  forward_sync_buffers=False)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def save(self, root: Path, step: int, state: dict, is_main: bool) -> None:
        # every process holds the same weights and optimizer state after a step: rank 0's copy is the checkpoint
        if is_main:
            save_checkpoint(root, step, state | {
                "student": self.trainee.student.state_dict(), "projections": self.trainee.projections.state_dict(),
                "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            })

    def load(self, state: dict, step_dir: Path) -> None:
        self.trainee.student.load_state_dict(state["student"])
        self.trainee.projections.load_state_dict(state["projections"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])

    def finish(self) -> None:
        """Nothing to do: the student was trained in place."""


class _ZeroEngine:
    """A DeepSpeed ZeRO engine: weights, gradients and AdamW states sharded across processes (deepspeed imported here only)."""

    format = "deepspeed"

    def __init__(self, trainee: _Trainee, cfg: DistillConfig, config: dict):
        import deepspeed

        self.trainee = trainee
        # ZeRO-3 partitions the module it is given in place; training a copy keeps the caller's student whole for
        # evaluation and saving (finish() copies the trained fp32 weights back). The cost is one more copy of a
        # student that has to fit on one device anyway, next to the whole teacher.
        model = copy.deepcopy(trainee)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup(cfg))
        # engine.step() clips (gradient_clipping in the config), steps AdamW and the scheduler, and zeroes gradients
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config,
                                                           dist_init_required=False)
        self.module = self.engine

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def step(self) -> None:
        self.engine.step()

    def save(self, root: Path, step: int, state: dict, is_main: bool) -> None:
        import torch.distributed as dist

        # each process writes its own shard into the checkpoint's tmp dir; rank 0 then adds state.pt and renames it
        tmp = root / f"step-{step:08d}.tmp"
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        self.engine.save_checkpoint(str(tmp), tag="engine", save_latest=False)
        dist.barrier()
        if is_main:
            save_checkpoint(root, step, state, started=True)

    def load(self, state: dict, step_dir: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(step_dir), tag="engine")
        if path is None:
            raise RuntimeError(f"DeepSpeed found no engine checkpoint under {step_dir}; delete {step_dir.parent} to start over")

    def finish(self) -> None:
        """Copy the trained fp32 master weights (gathered from every process: collective) into the caller's modules."""
        from deepspeed.utils import safe_get_full_fp32_param

        with torch.no_grad():
            for src, dst in zip(self.engine.module.parameters(), self.trainee.parameters()):
                full = safe_get_full_fp32_param(src)
                if full is not None:  # None: a frozen weight, never updated
                    dst.copy_(full.reshape(dst.shape).to(dst.device, dst.dtype))


# CPU flags of native bfloat16 matrix math (AVX-512 BF16 dot products, AMX tiles); without them oneDNN emulates bf16
# and an autocast step is slower than fp32.
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def default_device() -> torch.device:
    """Where a single-process run trains: the first CUDA device when there is one, else the CPU (run_distill)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast_dtype(mode: str, device: torch.device | str) -> torch.dtype | None:
    """The dtype distill.mixed_precision (`mode`) runs the forward passes in on `device`; None: fp32, no autocast."""
    device = torch.device(device)
    if mode == "off":
        return None
    if mode == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and cpu_flags() & NATIVE_BF16_CPU_FLAGS else None


def precision_label(mode: str, device: torch.device | str | None = None) -> str:
    """'bf16' or 'fp32': what the teacher's forward computes in under `mode` on `device` (default_device when None)."""
    return "fp32" if autocast_dtype(mode, device or default_device()) is None else "bf16"


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def train(teacher, student, data: TokenDataset | list[list[int]], cfg: DistillConfig, pad_id: int, *,
          layer_map: dict[int, int] | None = None, checkpoint_dir: Path | None = None, run_label: str = "local",
          log: LogFn | None = None, zero_config: dict | None = None, teacher_cache: TeacherCache | None = None) -> DistillResult:
    """Run the distillation loop; `log(step, metrics)` receives each step's kd, ce, hidden_mse, total, lr and tokens_per_s.

    Resumes from the newest checkpoint in checkpoint_dir (if any) and writes one every cfg.checkpoint_every steps.
    Under an initialized torch.distributed process group (edgeflow/distill/launch.py) every process runs this loop on its
    share of each step's batch, with DistributedDataParallel, or a DeepSpeed ZeRO engine when zero_config (a DeepSpeed
    config dict) is given; the logged terms are the whole step's, and only rank 0 logs, pushes gauges and writes
    checkpoints (a ZeRO engine's shards are written by every process).

    With a `teacher_cache` (edgeflow/distill/teacher_cache.py) the teacher's outputs come from it, the teacher runs only on
    the sequences it lacks, and the KD term is the top-k one (kd_sums_topk); every process writes what it computed to
    the cache at each checkpoint and at the end.
    """
    # setup: refuse what cannot train, then the trained module, its optimizer engine and the batch order
    check_teacher_frozen(teacher)
    check_no_shared_storage(teacher, student)
    if cfg.beta > 0 and not layer_map:
        raise ValueError("distill.beta > 0 needs a teacher->student layer map (resolve_layer_map)")
    rank, world = _rank_world()
    if zero_config is not None and world == 1:
        raise ValueError("a DeepSpeed ZeRO engine needs an initialized torch.distributed process group; run through "
                         "edgeflow.distill.launch (distill.processes > 1), or train without zero_config")
    is_main = rank == 0
    log = log if is_main else None
    use_hidden = cfg.beta > 0
    device = next(student.parameters()).device
    # bf16 forward passes where the device computes them natively (distill.mixed_precision); the student's own under
    # a ZeRO engine follow its DeepSpeed config instead, and the loss terms always upcast to fp32 (edgeflow/distill/losses.py)
    amp = autocast_dtype(cfg.mixed_precision, device)
    student_amp = amp if zero_config is None else None
    teacher.eval()
    student.train()
    if cfg.gradient_checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    t_layers = sorted(layer_map) if use_hidden else []
    s_layers = [layer_map[t] for t in t_layers]
    torch.manual_seed(cfg.seed)  # projection init is the same on a fresh and a resumed run (then overwritten by it)
    projections = make_projections(s_layers, student.config.hidden_size, teacher.config.hidden_size).to(device)
    trainee = _Trainee(student, projections, s_layers)
    engine = _ZeroEngine(trainee, cfg, zero_config) if zero_config is not None else _TorchEngine(trainee, cfg, world, device)
    order = BatchOrder(len(data), cfg.batch_size, cfg.seed)
    history: list[dict[str, float]] = []
    tokens, train_s, start = 0, 0.0, 0
    written: list[int] = []

    # resume from the newest checkpoint, if any: weights, optimizer, RNG streams, data position and history
    found = find_checkpoint(checkpoint_dir, rank, world)
    if found:
        _, state_file = found
        state = load_checkpoint(state_file, checkpoint_dir, device, len(data), cfg.batch_size, engine.format, world)
        engine.load(state, state_file.parent)
        set_rng_state(rank_rng(state, rank, world))
        history, tokens, train_s, start = state["history"], state["tokens"], state["train_s"], state["data"]["next_step"]
        logger.info("resumed from step %d (%s)", start, state_file.parent)
        if is_main:
            print(f"distill: resumed from step {start} ({state_file.parent})")
        if log:
            log(start, {"resumed_from_step": float(start)})

    # work: one optimizer step per batch, under the stall watchdog
    pusher = GaugePusher(cfg.pushgateway_url, run_label) if cfg.pushgateway_url and is_main else None
    watchdog = StallWatchdog(cfg.stall_timeout_s, cfg.steps, pusher.mark_stalled if pusher else None)
    progress = LoopProgress("distillation", cfg.steps, "steps", start=start) if is_main else None
    with watchdog:
        watchdog.beat(start)
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            batch = [data[i] for i in order.indices(step, rank, world)]
            input_ids, attn, labels = (x.to(device) for x in collate(batch, pad_id))
            watchdog.check()
            check_teacher_frozen(teacher)  # every step: a callback or hook must not unfreeze it mid-run
            if teacher_cache is not None:
                with _autocast(device, amp):  # the cache's namespace records the precision (cache_spec)
                    t_idx, t_logp, t_hidden = teacher_cache.outputs(teacher, batch, input_ids, attn, t_layers)
            else:
                with torch.no_grad(), _autocast(device, amp):
                    t_out = teacher(input_ids=input_ids, attention_mask=attn, output_hidden_states=use_hidden, use_cache=False)
                t_hidden = _hidden(t_out, t_layers) if use_hidden else []
            with _autocast(device, student_amp):
                logits, s_hidden = engine.module(input_ids, attn, use_hidden)
            if teacher_cache is not None:
                sums = StepSums(*kd_sums_topk(logits, t_idx, t_logp, labels, cfg.temperature))
            else:
                sums = StepSums(*kd_sums(logits, t_out.logits, labels, cfg.temperature))
            if use_hidden:
                sums.sse, sums.tsq, _ = hidden_sums(s_hidden, t_hidden, attn)
            # each process divides its sums by the whole step's token count and teacher norms, so the processes' losses
            # add up to the one-process loss of the whole batch, however padding and lengths fall across them
            divisors = _all_sum(sums.divisors(), world)
            loss, shares = rank_share(sums, divisors, cfg.alpha, cfg.beta)
            # DDP and ZeRO average gradients over processes; scaled by the process count, that average is the sum of
            # the processes' gradients: the one-process gradient of the whole batch
            engine.backward(loss * world)
            watchdog.check()
            lr = engine.lr()  # the rate this step used (the scheduler moves it on below)
            engine.step()
            watchdog.beat(step + 1)
            watchdog.check()
            dt = time.perf_counter() - t0
            n_local = float(attn.sum())
            step_total = _all_sum(torch.cat([shares.double(), torch.tensor([n_local], dtype=torch.float64, device=shares.device)]), world)
            kd, ce, hid, total, n_tok = step_total.tolist()
            n_tok = int(n_tok)
            tokens, train_s = tokens + n_tok, train_s + dt
            parts = {"kd": kd, "ce": ce, "hidden_mse": hid, "total": total, "lr": lr, "tokens_per_s": n_tok / max(dt, 1e-9)}
            history.append(parts | {"step": step})
            if log:
                log(step, parts)
            if pusher and ((step + 1) % cfg.push_every == 0 or step + 1 == cfg.steps):
                pusher.push(step + 1, parts["total"], parts["tokens_per_s"])
            done = step + 1
            if progress:
                progress.update(done)
            if checkpoint_dir and cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
                if teacher_cache is not None:
                    teacher_cache.flush()  # a resumed run finds what this one computed so far
                rngs = gather_rng(world)
                engine.save(checkpoint_dir, done, {
                    "rng": rngs[0], "rng_ranks": rngs, "engine": {"format": engine.format, "world_size": world},
                    "data": {"next_step": done, "samples": len(data), "batch_size": cfg.batch_size, "seed": cfg.seed},
                    "history": history, "tokens": tokens, "train_s": train_s,
                }, is_main)
                written.append(done)
                watchdog.beat()
    # finish: the teacher outputs this run computed saved for the next, the trained weights in the caller's student,
    # in eval mode for evaluation and saving
    cache_metrics: dict[str, float] = {}
    if teacher_cache is not None:
        teacher_cache.flush()
        counts = _all_sum(torch.tensor([teacher_cache.stats.hits, teacher_cache.stats.misses, teacher_cache.stats.bytes_written],
                                       dtype=torch.float64, device=device), world).tolist()
        cache_metrics = {"teacher_cache_hits": counts[0], "teacher_cache_misses": counts[1], "teacher_cache_bytes_written": counts[2],
                         "teacher_cache_hit_rate": counts[0] / max(counts[0] + counts[1], 1)}
    engine.finish()
    if cfg.gradient_checkpointing:
        student.gradient_checkpointing_disable()
    student.eval()
    return DistillResult(
        steps=cfg.steps,
        final_loss=history[-1]["total"] if history else float("nan"),
        history=history,
        tokens_per_s=tokens / max(train_s, 1e-9),
        teacher_params=count_params(teacher),
        student_params=count_params(student),
        resumed_from_step=start,
        checkpoints_written=written,
        processes=world,
        teacher_cache=cache_metrics,
    )

