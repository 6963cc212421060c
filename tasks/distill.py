"""Knowledge distillation: teacher -> layer-dropped student, trained with α·KL·T² + (1−α)·CE.

Tiny CPU run: python -m flows.distill --profile configs/test-tiny.yaml
"""
from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.artifacts import write_manifest
from tasks.config import DistillConfig
from tasks.losses import kd_loss
from tasks.textdata import load_texts


@dataclass
class DistillResult:
    """What the training loop measured."""

    steps: int
    final_loss: float
    history: list[dict[str, float]]
    tokens_per_s: float
    teacher_params: int
    student_params: int


def keep_layers(teacher, keep: list[int]):
    """A copy of `teacher` keeping only decoder layers `keep` (same widths, same tokenizer)."""
    n = teacher.config.num_hidden_layers
    bad = [i for i in keep if not 0 <= i < n]
    if bad or not keep:
        raise ValueError(f"distill layer list {keep} is invalid for a {n}-layer teacher; use indices 0..{n - 1}")
    student = copy.deepcopy(teacher)
    student.model.layers = torch.nn.ModuleList([student.model.layers[i] for i in keep])
    for new_idx, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = new_idx  # the KV cache is indexed by position in the stack
    student.config.num_hidden_layers = len(keep)
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = [student.config.layer_types[i] for i in keep]
    for p in student.parameters():
        p.requires_grad_(True)
    return student


def every_kth(n_layers: int, k: int) -> list[int]:
    """Layers 0, k, 2k, … (the last layer is kept too: it feeds the shared norm and lm_head)."""
    keep = list(range(0, n_layers, k))
    if keep[-1] != n_layers - 1:
        keep.append(n_layers - 1)
    return keep


def tokenize_corpus(texts: list[str], tokenizer, max_seq_len: int) -> tuple[list[list[int]], int]:
    """Token ids per text, truncated to max_seq_len; returns (ids, number truncated)."""
    ids, truncated = [], 0
    for t in texts:
        toks = tokenizer(t, add_special_tokens=False)["input_ids"]
        if len(toks) > max_seq_len:
            truncated += 1
            toks = toks[:max_seq_len]
        if len(toks) >= 2:
            ids.append(toks)
    return ids, truncated


def _batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    labels = input_ids.clone()
    labels[attn == 0] = -100
    # position t predicts token t+1
    labels = torch.cat([labels[:, 1:], torch.full((len(seqs), 1), -100)], dim=1)
    return input_ids, attn, labels


def train(teacher, student, tokenizer, seqs: list[list[int]], cfg: DistillConfig, log=None) -> DistillResult:
    """Run the distillation loop; `log(step, metrics)` receives each step's loss terms."""
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student.train()
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.steps // 10)))
    rng = random.Random(cfg.seed)
    order: list[int] = []
    history: list[dict[str, float]] = []
    tokens, t0 = 0, time.perf_counter()
    pad_id = tokenizer.pad_token_id
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(seqs)), len(seqs))
        batch = [seqs[order.pop()] for _ in range(cfg.batch_size)]
        input_ids, attn, labels = _batch(batch, pad_id)
        assert not any(p.requires_grad for p in teacher.parameters()), "teacher must stay frozen"
        with torch.no_grad():
            t_logits = teacher(input_ids=input_ids, attention_mask=attn).logits
        s_logits = student(input_ids=input_ids, attention_mask=attn).logits
        loss, parts = kd_loss(s_logits, t_logits, labels, cfg.alpha, cfg.temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        tokens += int(attn.sum())
        parts |= {"lr": sched.get_last_lr()[0], "step": step}
        history.append(parts)
        if log:
            log(step, parts)
    student.eval()
    elapsed = max(time.perf_counter() - t0, 1e-9)
    return DistillResult(
        steps=cfg.steps,
        final_loss=history[-1]["loss"] if history else float("nan"),
        history=history,
        tokens_per_s=tokens / elapsed,
        teacher_params=sum(p.numel() for p in teacher.parameters()),
        student_params=sum(p.numel() for p in student.parameters()),
    )


@torch.no_grad()
def compare_to_teacher(teacher, student, seqs: list[list[int]]) -> dict[str, float]:
    """Held-out top-1 agreement of student with teacher, and both perplexities."""
    agree = total = 0
    nll_t = nll_s = 0.0
    for s in seqs:
        ids = torch.tensor([s])
        lt = teacher(input_ids=ids).logits[0, :-1].float()
        ls = student(input_ids=ids).logits[0, :-1].float()
        target = ids[0, 1:]
        agree += int((lt.argmax(-1) == ls.argmax(-1)).sum())
        total += len(target)
        nll_t += float(torch.nn.functional.cross_entropy(lt, target, reduction="sum"))
        nll_s += float(torch.nn.functional.cross_entropy(ls, target, reduction="sum"))
    ppl_t, ppl_s = math.exp(nll_t / total), math.exp(nll_s / total)
    return {
        "student_top1_vs_teacher": agree / total,
        "teacher_ppl": ppl_t,
        "student_ppl": ppl_s,
        # Quality as % of teacher: ratio of perplexities (100 % = as good as the teacher).
        "student_quality_pct": 100.0 * ppl_t / ppl_s,
    }


def run_distill(teacher_dir: Path, cfg: DistillConfig, corpora: list[Path], eval_texts: list[str], out_dir: Path, log=None) -> dict:
    """Setup → train → evaluate → save. Returns metrics; the student lands in out_dir as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    student = keep_layers(teacher, every_kth(teacher.config.num_hidden_layers, cfg.keep_every_k))
    seqs, truncated = tokenize_corpus(load_texts(corpora, tokenizer), tokenizer, cfg.max_seq_len)
    if not seqs:
        raise ValueError(f"distill.corpora {corpora} produced no training sequences of 2+ tokens")
    held_out, _ = tokenize_corpus(eval_texts, tokenizer, cfg.max_seq_len)
    before = compare_to_teacher(teacher, student, held_out)

    result = train(teacher, student, tokenizer, seqs, cfg, log=log)
    after = compare_to_teacher(teacher, student, held_out)

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    student.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_manifest(tmp)
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return {
        **after,
        "student_ppl_before_training": before["student_ppl"],
        "final_loss": result.final_loss,
        "tokens_per_s": result.tokens_per_s,
        "teacher_params": result.teacher_params,
        "student_params": result.student_params,
        "size_ratio": result.teacher_params / result.student_params,
        "student_layers": student.config.num_hidden_layers,
        "truncated_samples": truncated,
        "training_sequences": len(seqs),
        "history": result.history,
    }
