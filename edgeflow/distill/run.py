"""The distill stage's entry point: run_distill (checks -> training set -> train, resumable -> held-out evaluation ->
save, in this process), and its two halves around train(), prepare_run and finish_run, which each process of a
multi-process run uses too (edgeflow/distill/launch.py); compare_to_teacher is the held-out evaluation before and after.

Tiny CPU run (services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml --deploy none
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeflow.model.architecture import transformers_kwargs
from edgeflow.tracking.artifacts import sha256_tree, write_manifest
from edgeflow.profile import DistillConfig
from edgeflow.distill.checkpoints import checkpoint_root, distill_run_key
from edgeflow.distill.checks import (PARAM_RATIO_GUIDELINE, check_memory_budget, check_no_shared_storage, check_teacher_frozen,
                                  check_vocab, load_tokenizer, param_ratio)
from edgeflow.distill.data import TokenDataset, prepare_dataset, tokenize_corpus
from edgeflow.distill.student import BLOCK_PROBE_SEQS, build_student, count_params, resolve_layer_map
from edgeflow.distill.teacher_cache import CacheSpec, TeacherCache, bytes_per_token
from edgeflow.distill.train import DistillResult, LogFn, default_device, precision_label, train


# The teacher's held-out logits are kept (in host memory) for the comparisons before and after training when they fit
# in this many bytes: the CPU demo's 24 sequences of <= 128 tokens over a 49,152-token vocabulary are about 600 MB,
# and they spare one of its two teacher passes (the two comparisons took 41 s of the demo's release, docs/benchmarks/history/2026-12-03.md).
# A production vocabulary at 2,048 tokens needs tens of GB: there the teacher runs once per comparison, as before.
KEEP_TEACHER_LOGITS_BYTES = 1 << 30


@torch.no_grad()
def teacher_logits(teacher, seqs: list[list[int]]) -> list[torch.Tensor] | None:
    """The teacher's logits on each held-out sequence (float32, on the CPU) for compare_to_teacher, or None when they
    would take more than KEEP_TEACHER_LOGITS_BYTES (each comparison then runs the teacher itself)."""
    if sum(len(s) - 1 for s in seqs) * teacher.config.vocab_size * 4 > KEEP_TEACHER_LOGITS_BYTES:
        return None
    device = next(teacher.parameters()).device
    return [teacher(input_ids=torch.tensor([s], device=device), use_cache=False).logits[0, :-1].float().cpu() for s in seqs]


@torch.no_grad()
def compare_to_teacher(teacher, student, seqs: list[list[int]], teacher_out: list[torch.Tensor] | None = None) -> dict[str, float]:
    """Held-out top-1 agreement of student with teacher, mean KL(teacher ‖ student), and both perplexities.
    teacher_out: teacher_logits(teacher, seqs) when kept, else None (the teacher runs here)."""
    agree = total = 0
    nll_t = nll_s = kl = 0.0
    device = next(student.parameters()).device
    for i, s in enumerate(seqs):
        ids = torch.tensor([s], device=device)
        if teacher_out is not None:
            lt = teacher_out[i].to(device)
        else:
            lt = teacher(input_ids=ids, use_cache=False).logits[0, :-1].float()
        ls = student(input_ids=ids, use_cache=False).logits[0, :-1].float()
        target = ids[0, 1:]
        agree += int((lt.argmax(-1) == ls.argmax(-1)).sum())
        total += len(target)
        nll_t += float(torch.nn.functional.cross_entropy(lt, target, reduction="sum"))
        nll_s += float(torch.nn.functional.cross_entropy(ls, target, reduction="sum"))
        log_pt, log_ps = lt.log_softmax(-1), ls.log_softmax(-1)
        kl += float((log_pt.exp() * (log_pt - log_ps)).sum())
    ppl_t, ppl_s = math.exp(nll_t / total), math.exp(nll_s / total)
    return {
        "student_top1_vs_teacher": agree / total,
        "student_kl_vs_teacher": kl / total,
        "teacher_ppl": ppl_t,
        "student_ppl": ppl_s,
        # Quality as % of teacher: ratio of perplexities (100 % = as good as the teacher).
        "student_quality_pct": 100.0 * ppl_t / ppl_s,
        "eval_positions": total,
    }



@dataclass
class PreparedRun:
    """Everything a distillation run has before its first step: checked models, the training set, held-out text."""

    tokenizer: object
    teacher: torch.nn.Module
    student: torch.nn.Module
    layer_map: dict[int, int] | None
    checks: dict[str, float]
    data: TokenDataset
    data_stats: dict
    held_out: list[list[int]]
    run_key: str
    checkpoint_dir: Path
    teacher_cache: TeacherCache | None = None
    generation_defaults: dict | None = None


def teacher_cache_root(work_dir: Path) -> Path:
    """Where this host keeps teacher-output shards (edgeflow/distill/teacher_cache.py), one directory per namespace."""
    return Path(work_dir) / "cache" / "teacher-outputs"


def cache_spec(cfg: DistillConfig, teacher_sha256: str, device: torch.device | str | None = None) -> CacheSpec:
    """The namespace of the teacher outputs a run with cfg reads and writes on `device` (default_device when None)."""
    return CacheSpec(teacher_sha256, cfg.teacher_cache.top_k, cfg.temperature, cfg.teacher_cache.hidden_dtype,
                     precision_label(cfg.mixed_precision, device))


def check_cache_budget(cfg: DistillConfig, data_stats: dict, hidden_layers: int, hidden_size: int) -> float:
    """GB the run could add to the teacher-output cache (its distinct sequences, none cached); ValueError over max_gb."""
    seqs = min(cfg.steps * cfg.batch_size, data_stats["training_sequences"])
    tokens = seqs * data_stats["training_tokens"] / max(data_stats["training_sequences"], 1)
    gb = tokens * bytes_per_token(cfg.teacher_cache.top_k, hidden_layers, hidden_size) / 1e9
    if gb > cfg.teacher_cache.max_gb:
        raise ValueError(
            f"distill.teacher_cache: this run would store up to {gb:,.1f} GB of teacher outputs ({seqs:,} sequences, {tokens:,.0f} "
            f"tokens, top_k={cfg.teacher_cache.top_k} and {hidden_layers} hidden layers of width {hidden_size}), over "
            f"distill.teacher_cache.max_gb={cfg.teacher_cache.max_gb:g}. Fix: lower top_k, match fewer layers "
            "(distill.hidden_layer_map, or beta: 0), raise max_gb, or set distill.teacher_cache.enabled: false"
        )
    return gb


def prepare_run(teacher_dir: Path, cfg: DistillConfig, corpora: list[Path], eval_texts: list[str], work_dir: Path,
                student_from: Path | None = None, log: LogFn | None = None, teacher_sha256: str | None = None) -> PreparedRun:
    """Checks that need no training (tokenizers, vocabularies, frozen teacher, memory budget, size ratio), then the
    models (on the CPU), the training set (built once, cached by content) and the teacher-output cache (when enabled;
    its namespace is keyed by teacher_sha256, the teacher directory's tree hash, computed here when not given)."""
    from transformers import AutoModelForCausalLM

    log = log or (lambda step, metrics: None)
    tokenizer = load_tokenizer(teacher_dir, student_from)
    torch.manual_seed(cfg.seed)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32, **transformers_kwargs(teacher_dir))
    teacher.requires_grad_(False)
    teacher.eval()
    check_vocab(teacher, tokenizer, "teacher")
    # drop_block chooses its block on training sequences, so only then is the training set built before the checks
    prepared = prepare_dataset(corpora, tokenizer, cfg, work_dir / "cache" / "distill-data") if cfg.drop_block else None
    probe = [prepared[0][i] for i in range(min(len(prepared[0]), BLOCK_PROBE_SEQS))] if prepared else None
    student, kept = build_student(teacher, cfg, student_from, probe)
    if student.config.vocab_size != teacher.config.vocab_size:
        raise ValueError(
            f"distill.student_from={student_from}: the student's vocab_size {student.config.vocab_size} != the teacher's "
            f"{teacher.config.vocab_size}; logit distillation needs the same output vocabulary (the teacher's tokenizer)"
        )
    layer_map = resolve_layer_map(cfg, teacher.config.num_hidden_layers, student.config.num_hidden_layers, kept) if cfg.beta > 0 else None
    d_s, d_t = student.config.hidden_size, teacher.config.hidden_size
    n_proj = len(layer_map) * d_s * d_t if layer_map and d_s != d_t else 0
    n_teacher, n_student = count_params(teacher), count_params(student)
    memory_mb = check_memory_budget(sum(p.numel() for p in student.parameters() if p.requires_grad) + n_proj, cfg)
    ratio = param_ratio(n_teacher, n_student)
    check_teacher_frozen(teacher)
    check_no_shared_storage(teacher, student)
    checks = {"teacher_params": n_teacher, "student_params": n_student, "size_ratio": ratio,
              "param_ratio_in_guideline": float(PARAM_RATIO_GUIDELINE[0] <= ratio <= PARAM_RATIO_GUIDELINE[1]),
              "student_training_memory_mb": memory_mb, "student_layers": student.config.num_hidden_layers}
    log(0, checks)

    data, data_stats = prepared or prepare_dataset(corpora, tokenizer, cfg, work_dir / "cache" / "distill-data")
    log(0, {k: v for k, v in data_stats.items() if k != "dataset_key"})
    held_out, _ = tokenize_corpus(eval_texts, tokenizer, cfg.max_seq_len)
    if not held_out:
        raise ValueError("no held-out evaluation text of 2+ tokens; check gate.eval_sources")
    run_key = distill_run_key(teacher_dir, student_from, cfg, data_stats["dataset_key"])
    cache = None
    if cfg.teacher_cache.enabled:
        gb = check_cache_budget(cfg, data_stats, len(layer_map or {}), teacher.config.hidden_size)
        cache = TeacherCache(teacher_cache_root(work_dir), cache_spec(cfg, teacher_sha256 or sha256_tree(teacher_dir)))
        log(0, {"teacher_cache_sequences_before": len(cache), "teacher_cache_max_new_gb": gb})
    return PreparedRun(tokenizer, teacher, student, layer_map, checks, data, data_stats, held_out, run_key,
                       checkpoint_root(work_dir, run_key), cache, cfg.generation_defaults)


def finish_run(run: PreparedRun, before: dict[str, float], result: DistillResult, out_dir: Path,
               teacher_out: list[torch.Tensor] | None = None) -> dict:
    """Evaluate the trained student against the teacher (teacher_out: its held-out logits, when kept since the
    comparison before training), save it (with the tokenizer and a manifest) to out_dir, drop the run's
    checkpoints, and return run_distill's metrics."""
    after = compare_to_teacher(run.teacher, run.student, run.held_out, teacher_out)
    run.student.to("cpu")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if run.generation_defaults:  # what the edge server decodes with when a request sets nothing
        for k, v in run.generation_defaults.items():
            setattr(run.student.generation_config, k, int(v) if k == "top_k" else v)
    run.student.save_pretrained(tmp)
    run.tokenizer.save_pretrained(tmp)
    write_manifest(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    # The student is saved: its checkpoints are no longer needed (a retry now hits the Prefect cache).
    shutil.rmtree(run.checkpoint_dir, ignore_errors=True)
    return {
        **after,
        "student_ppl_before_training": before["student_ppl"],
        "student_top1_before_training": before["student_top1_vs_teacher"],
        "student_kl_before_training": before["student_kl_vs_teacher"],
        "final_loss": result.final_loss,
        "mean_tokens_per_s": result.tokens_per_s,
        "resumed_from_step": result.resumed_from_step,
        "training_processes": result.processes,
        **result.teacher_cache,
        **run.checks,
        **{k: v for k, v in run.data_stats.items() if k != "dataset_key"},
        "history": result.history,
    }


def run_distill(teacher_dir: Path, cfg: DistillConfig, corpora: list[Path], eval_texts: list[str], out_dir: Path,
                work_dir: Path, student_from: Path | None = None, log: LogFn | None = None,
                teacher_sha256: str | None = None) -> dict:
    """Checks → training set → train (resumable) → evaluate → save, in this process. Returns metrics; the student
    lands in out_dir. edgeflow/distill/launch.py:run_distill_distributed is the same over several processes."""
    run = prepare_run(teacher_dir, cfg, corpora, eval_texts, work_dir, student_from, log, teacher_sha256)
    device = default_device()  # the device cache_spec resolved the teacher-output namespace's precision for
    run.teacher.to(device)
    run.student.to(device)
    teacher_out = teacher_logits(run.teacher, run.held_out)
    before = compare_to_teacher(run.teacher, run.student, run.held_out, teacher_out)
    result = train(run.teacher, run.student, run.data, cfg, run.tokenizer.pad_token_id, layer_map=run.layer_map,
                   checkpoint_dir=run.checkpoint_dir, run_label=run.run_key[:12], log=log, teacher_cache=run.teacher_cache)
    return finish_run(run, before, result, out_dir, teacher_out)
