"""Knowledge distillation: teacher -> student, trained with α·KL·T² + (1−α)·CE (+ β·hidden-state MSE).

Order of work in run_distill: checks that need no compute (tokenizers, frozen teacher, memory budget,
size ratio) -> training set built once into Parquet (cached by content hash) -> resumable training loop
(checkpoints keyed by the run's content hash, stall watchdog, Pushgateway gauges) -> held-out evaluation.
The same loop runs in every process of a multi-process run (tasks/distill_launch.py), each on its share of a step.

Tiny CPU run: python -m flows.distill --profile configs/test-tiny.yaml
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import threading
import time
import traceback
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from tasks.artifacts import MANIFEST, sha256_file, sha256_json, sha256_tree, write_manifest
from tasks.config import DistillConfig
from tasks.losses import (StepSums, check_layer_map, default_layer_map, hidden_sums, kd_sums, make_projections, rank_share,
                          spread_layer_map)
from tasks.textdata import read_records, record_text

logger = logging.getLogger("edgeflow.distill")

LogFn = Callable[[int, dict[str, float]], None]

# The field's guideline for a distilled student's size: 5-10x fewer parameters than its teacher.
PARAM_RATIO_GUIDELINE = (5.0, 10.0)
# fp32 weights + fp32 gradients + AdamW's two fp32 moments.
TRAINING_BYTES_PER_PARAM = 16
# Bump when the Parquet layout changes, so old caches are not read with new code.
DATA_FORMAT = 1


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


# ---------------------------------------------------------------------------------------------- student


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


def kept_layers(cfg: DistillConfig, n_layers: int) -> list[int]:
    """The teacher layers a layer-dropped student keeps: cfg.keep_layers, else every keep_every_k-th."""
    if cfg.keep_layers is None:
        return every_kth(n_layers, cfg.keep_every_k)
    bad = [i for i in cfg.keep_layers if i >= n_layers]
    if bad:
        raise ValueError(
            f"distill.keep_layers={cfg.keep_layers} names layers {bad} but the teacher has {n_layers} (0..{n_layers - 1}); "
            "drop them from keep_layers"
        )
    return list(cfg.keep_layers)


def _has_weights(d: Path) -> bool:
    return any(d.glob("*.safetensors")) or (d / "pytorch_model.bin").exists()


def build_student(teacher, cfg: DistillConfig, student_from: Path | None = None):
    """(student, kept teacher layers or None): a layer-dropped copy of the teacher, or the model at student_from
    (its checkpoint, or a fresh seeded init when the directory holds only a config.json)."""
    if student_from is None:
        kept = kept_layers(cfg, teacher.config.num_hidden_layers)
        return keep_layers(teacher, kept), kept
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (student_from / "config.json").exists():
        raise FileNotFoundError(
            f"distill.student_from={student_from} has no config.json; point it at a saved model or config directory"
        )
    if _has_weights(student_from):
        student = AutoModelForCausalLM.from_pretrained(student_from, dtype=torch.float32)
    else:
        torch.manual_seed(cfg.seed)  # a config-only student is initialised the same way on every (re)run
        student = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(student_from), dtype=torch.float32)
    student.requires_grad_(True)
    return student, None


def resolve_layer_map(cfg: DistillConfig, n_teacher: int, n_student: int, kept: list[int] | None) -> dict[int, int]:
    """Teacher layer -> student layer pairs for the beta term: the configured map, else one derived from the student."""
    if cfg.hidden_layer_map is not None:
        layer_map = dict(cfg.hidden_layer_map)
    elif kept is not None:
        layer_map = default_layer_map(kept)
    else:
        layer_map = spread_layer_map(n_teacher, n_student)
    check_layer_map(layer_map, n_teacher, n_student)
    return layer_map


# ----------------------------------------------------------------------------------------------- checks


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=False, separators=(",", ":")).encode()).hexdigest()


def tokenizer_fingerprint(tokenizer) -> dict[str, str]:
    """What decides a tokenizer's ids and prompts: vocabulary, tokenization rules, special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # the serialized tokenizer (vocab, merges, normalizer, pre-tokenizer, added tokens) in its own fixed order,
        # without truncation/padding: runtime settings, not part of what an id means
        spec = json.loads(backend.to_str())
        rules = _sha({k: v for k, v in spec.items() if k not in ("truncation", "padding")})
    else:
        rules = _sha(sorted(tokenizer.get_vocab().items()))
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    specials |= {f"{k}_id": str(getattr(tokenizer, f"{k}_id", None)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    added = {str(i): str(t) for i, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())}
    return {
        "tokenizer": rules,
        "vocab_size": str(len(tokenizer)),
        "special_tokens": json.dumps(specials | {"added": added}, sort_keys=True),
        "chat_template": str(tokenizer.chat_template or ""),
    }


def check_same_tokenizer(teacher_tok, student_tok, teacher_dir: Path, student_dir: Path) -> None:
    """Refuse a student whose tokenizer differs from the teacher's: logit distillation compares ids one to one."""
    a, b = tokenizer_fingerprint(teacher_tok), tokenizer_fingerprint(student_tok)
    diffs = []
    if a["tokenizer"] != b["tokenizer"] or a["vocab_size"] != b["vocab_size"]:
        tv, sv = teacher_tok.get_vocab(), student_tok.get_vocab()
        if tv != sv:
            only_t = sorted(set(tv) - set(sv))[:3]
            only_s = sorted(set(sv) - set(tv))[:3]
            moved = sorted(t for t in set(tv) & set(sv) if tv[t] != sv[t])[:3]
            diffs.append(f"vocabulary ({a['vocab_size']} vs {b['vocab_size']} tokens; only in teacher {only_t}, only in student "
                         f"{only_s}, different ids {moved})")
        else:
            diffs.append("tokenization rules (normalizer, pre-tokenizer or merges)")
    if a["special_tokens"] != b["special_tokens"]:
        ta, tb = json.loads(a["special_tokens"]), json.loads(b["special_tokens"])
        keys = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
        diffs.append("special tokens (" + "; ".join(f"{k}: {ta.get(k)!r} vs {tb.get(k)!r}" for k in keys)[:400] + ")")
    if a["chat_template"] != b["chat_template"]:
        diffs.append("chat template")
    if diffs:
        raise ValueError(
            f"tokenizer mismatch between the teacher ({teacher_dir}) and distill.student_from ({student_dir}): "
            + "; ".join(diffs)
            + ". Distillation matches the two models' distributions token id by token id, so they must share one tokenizer: "
            "use a student made with the teacher's tokenizer (or drop student_from to cut the student from the teacher)."
        )


def check_vocab(model, tokenizer, who: str) -> None:
    """Every token id the tokenizer can produce must have a row in the model's embedding."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ValueError(
            f"the {who}'s embedding has {rows} rows but its tokenizer has {len(tokenizer)} tokens: ids >= {rows} would index "
            "past it. Use the tokenizer the model was trained with."
        )


def trainable(model) -> list[str]:
    """Names of the parameters that would receive gradients."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def check_teacher_frozen(teacher) -> None:
    """Raise naming the trainable teacher parameters: the teacher is a fixed target, never updated."""
    names = trainable(teacher)
    if names:
        raise RuntimeError(
            f"the teacher has {len(names)} trainable parameters (e.g. {names[:3]}): distillation must never update it. "
            "Freeze it before training with teacher.requires_grad_(False) (run_distill does), and do not unfreeze it "
            "while training runs."
        )


def check_no_shared_storage(teacher, student) -> None:
    """A student that shares tensors with the teacher would train the teacher through them."""
    t_ptrs = {p.data_ptr() for p in teacher.parameters()}
    shared = [n for n, p in student.named_parameters() if p.data_ptr() in t_ptrs]
    if shared:
        raise RuntimeError(f"the student shares parameter storage with the teacher ({shared[:3]}); build it from a copy (keep_layers deep-copies)")


def training_memory_mb(n_trainable: int) -> float:
    """MiB for fp32 weights, gradients and AdamW's two moments of n trainable parameters (activations excluded)."""
    return n_trainable * TRAINING_BYTES_PER_PARAM / 2**20


def check_memory_budget(n_trainable: int, cfg: DistillConfig) -> float:
    """The estimate in MiB; raises when it exceeds cfg.memory_budget_mb."""
    need = training_memory_mb(n_trainable)
    if cfg.memory_budget_mb is not None and need > cfg.memory_budget_mb:
        raise ValueError(
            f"the student needs ~{need:,.0f} MiB for weights, gradients and AdamW states ({n_trainable:,} trainable parameters x "
            f"{TRAINING_BYTES_PER_PARAM} bytes; activations come on top) > distill.memory_budget_mb={cfg.memory_budget_mb:,.0f}. "
            "Keep fewer layers (distill.keep_every_k / distill.keep_layers), choose a smaller student_from, or raise memory_budget_mb."
        )
    return need


def param_ratio(teacher_params: int, student_params: int) -> float:
    """Teacher/student parameter ratio; warns (never fails) outside the field's 5-10x guideline."""
    ratio = teacher_params / student_params
    lo, hi = PARAM_RATIO_GUIDELINE
    if not lo <= ratio <= hi:
        msg = (f"teacher/student parameter ratio {ratio:.1f}x ({teacher_params:,} / {student_params:,}) is outside the usual "
               f"{lo:.0f}-{hi:.0f}x for distillation: " + ("the student is barely smaller" if ratio < lo else "the student may be too small to follow the teacher"))
        warnings.warn(msg, stacklevel=2)
        logger.warning(msg)
    return ratio


def _count(model) -> int:
    # parameters() yields a tied tensor once: SmolLM2's embedding and lm_head count once, as they are stored
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------- data


def dataset_key(corpora: list[Path], tokenizer, max_seq_len: int, max_truncation_ratio: float) -> str:
    """Content hash of what the training set is made from (file bytes, tokenizer, truncation)."""
    return sha256_json({
        "format": DATA_FORMAT,
        "corpora": [sha256_file(p) for p in corpora],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_seq_len": max_seq_len,
        # part of the key: a cached set was checked against the ratio it was built with
        "max_truncation_ratio": max_truncation_ratio,
    })


TOKEN_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("n_tokens", pa.int32()), ("source", pa.int16()),
                          ("record", pa.int32()), ("truncated", pa.bool_())])


def write_sequences(seqs: list[list[int]], out: Path) -> Path:
    """Already tokenized sequences as a training-set Parquet file (same layout as build_token_dataset's)."""
    n = [len(x) for x in seqs]
    table = pa.table({"input_ids": seqs, "n_tokens": n, "source": [0] * len(seqs), "record": list(range(len(seqs))),
                      "truncated": [False] * len(seqs)}, schema=TOKEN_SCHEMA)
    stats = {"samples": len(seqs), "truncated": 0, "overlong": 0, "tokens": sum(n), "files": [], "max_seq_len": max(n, default=0)}
    table = table.replace_schema_metadata({"edgeflow": json.dumps(stats)})
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out, compression="none")
    return out


def build_token_dataset(corpora: list[Path], tokenizer, max_seq_len: int, max_truncation_ratio: float, out: Path,
                        key: str = "", row_group_size: int = 1024) -> dict:
    """Tokenize every record (rendered as the model sees it), truncate to max_seq_len and write one Parquet file.

    Refuses, naming the file, the record, its length and the fix:
    - a record with fewer than 2 tokens (nothing to predict; an empty record is a corpus bug);
    - a file whose every record has >= max_truncation_ratio x max_seq_len tokens: unsplit documents, of which
      training would see only the first max_seq_len tokens. A single over-long record among normal ones is
      truncated and counted, not refused.
    Returns the stats also stored in the file's metadata.
    """
    limit = max_truncation_ratio * max_seq_len
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    schema = TOKEN_SCHEMA
    stats = {"samples": 0, "truncated": 0, "overlong": 0, "tokens": 0, "files": [str(p) for p in corpora], "max_seq_len": max_seq_len}
    buf: dict[str, list] = {k: [] for k in schema.names}

    def flush(writer: pq.ParquetWriter) -> None:
        if buf["input_ids"]:
            writer.write_table(pa.table(buf, schema=schema))
            for v in buf.values():
                v.clear()

    try:
        # uncompressed: the file is memory-mapped at training time and read a row group at a time
        with pq.ParquetWriter(tmp, schema, compression="none") as writer:
            for src, path in enumerate(corpora):
                texts = [record_text(r, tokenizer) for r in read_records(path)]
                over_in_file, first_over = 0, None
                for start in range(0, len(texts), 256):
                    encoded = tokenizer(texts[start : start + 256], add_special_tokens=False)["input_ids"]
                    for i, ids in enumerate(encoded, start):
                        n = len(ids)
                        if n < 2:
                            raise ValueError(
                                f"distill.corpora: {path} record #{i} (0-based) has {n} token(s) after rendering; a training "
                                "sample needs at least 2 (one to read, one to predict). Remove or fill that record (clean the corpus)."
                            )
                        if n >= limit:
                            over_in_file += 1
                            first_over = first_over or (i, n)
                        buf["input_ids"].append(ids[:max_seq_len])
                        buf["n_tokens"].append(min(n, max_seq_len))
                        buf["source"].append(src)
                        buf["record"].append(i)
                        buf["truncated"].append(n > max_seq_len)
                        stats["samples"] += 1
                        stats["truncated"] += n > max_seq_len
                        stats["tokens"] += min(n, max_seq_len)
                        if len(buf["input_ids"]) >= row_group_size:
                            flush(writer)
                if texts and over_in_file == len(texts):
                    i, n = first_over
                    raise ValueError(
                        f"distill.corpora: every one of the {len(texts)} records in {path} has at least "
                        f"{max_truncation_ratio:g} x max_seq_len = {limit:,.0f} tokens (record #{i} (0-based) has {n:,}): truncated to "
                        f"max_seq_len={max_seq_len}, training would see only the first {max_seq_len / n:.1%} of it. This looks like "
                        "unsplit documents: split the file into samples (clean the corpus) or raise distill.max_seq_len "
                        "(distill.max_truncation_ratio only if truncating this much is intended)."
                    )
                stats["overlong"] += over_in_file
            flush(writer)
            writer.add_key_value_metadata({"edgeflow": json.dumps(stats | {"key": key})})
        if stats["samples"] == 0:
            raise ValueError(f"distill.corpora {[str(p) for p in corpora]} hold no records; name at least one non-empty training file")
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return stats


class TokenDataset:
    """Training sequences read from the memory-mapped Parquet file, one row group at a time (a few cached)."""

    def __init__(self, path: Path, cache_row_groups: int = 4):
        self.path = Path(path)
        self._file = pq.ParquetFile(pa.memory_map(str(self.path), "r"))
        md = self._file.metadata
        self.stats = json.loads(md.metadata[b"edgeflow"]) if md.metadata and b"edgeflow" in md.metadata else {}
        sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        self._starts = np.cumsum([0] + sizes)
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._cache_size = cache_row_groups

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        col = self._file.read_row_group(g, columns=["input_ids"]).column(0).combine_chunks()
        entry = (col.offsets.to_numpy(), col.values.to_numpy())
        self._cache[g] = entry
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return entry

    def __getitem__(self, i: int) -> list[int]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        g = int(np.searchsorted(self._starts, i, side="right") - 1)
        offsets, values = self._group(g)
        j = i - int(self._starts[g])
        return values[offsets[j] : offsets[j + 1]].tolist()


def prepare_dataset(corpora: list[Path], tokenizer, cfg: DistillConfig, cache_dir: Path) -> tuple[TokenDataset, dict]:
    """The training set for these inputs: built once, then found by content hash under cache_dir."""
    key = dataset_key(corpora, tokenizer, cfg.max_seq_len, cfg.max_truncation_ratio)
    path = cache_dir / f"{key[:32]}.parquet"
    hit = path.exists()
    if not hit:
        build_token_dataset(corpora, tokenizer, cfg.max_seq_len, cfg.max_truncation_ratio, path, key=key)
    data = TokenDataset(path)
    s = data.stats
    logger.info("training set %s: %d samples, %d truncated to %d tokens%s", path, s["samples"], s["truncated"],
                cfg.max_seq_len, " (cached)" if hit else "")
    return data, {"training_sequences": s["samples"], "truncated_samples": s["truncated"], "overlong_samples": s["overlong"],
                  "training_tokens": s["tokens"], "dataset_cache_hit": int(hit), "dataset_key": key}


def tokenize_corpus(texts: list[str], tokenizer, max_seq_len: int) -> tuple[list[list[int]], int]:
    """Token ids per text, truncated to max_seq_len; returns (ids, number truncated). Texts under 2 tokens are dropped."""
    ids, truncated = [], 0
    for t in texts:
        toks = tokenizer(t, add_special_tokens=False)["input_ids"]
        if len(toks) > max_seq_len:
            truncated += 1
            toks = toks[:max_seq_len]
        if len(toks) >= 2:
            ids.append(toks)
    return ids, truncated


class BatchOrder:
    """Which samples make step s's batch: a pure function of (seed, step), so a resumed run continues exactly.

    Each epoch is a fresh seeded permutation; the global batch of `batch_size` is split across ranks by
    striding (rank r takes positions r, r+world, …), as torch's DistributedSampler does.
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < 1:
            raise ValueError("the training set is empty")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            if len(self._perms) > 2:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def indices(self, step: int, rank: int = 0, world_size: int = 1) -> list[int]:
        """Sample indices of this rank's share of step `step`'s global batch."""
        first = step * self.batch_size
        positions = range(first + rank, first + self.batch_size, world_size)
        return [int(self._perm(p // self.n)[p % self.n]) for p in positions]


def collate(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) right-padded; labels are shifted so position t predicts token t+1."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    labels = input_ids.clone()
    labels[attn == 0] = -100
    labels = torch.cat([labels[:, 1:], torch.full((len(seqs), 1), -100)], dim=1)
    return input_ids, attn, labels


# ------------------------------------------------------------------------------------------ checkpoints

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


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        # this process's device only: in a multi-GPU run, reading every device's state would open a CUDA context
        # (hundreds of MiB) on every GPU from every process
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    cuda = s.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # written when checkpoints held every device's state
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda)
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])


def _rank_rng(state: dict, rank: int, world: int) -> dict:
    """The RNG state this process resumes with: its own when the checkpoint was written by as many processes."""
    ranks = state.get("rng_ranks")
    if ranks and len(ranks) == world:
        return ranks[rank]
    # another process count: every process continues rank 0's stream (it only feeds dropout, if any)
    return state["rng"]


# -------------------------------------------------------------------------------------------- telemetry


class TrainingStalled(RuntimeError):
    """No optimizer step completed within distill.stall_timeout_s."""


class StallWatchdog:
    """A timer thread that flags a stall when no step completes within `timeout_s`; the loop raises on the flag.

    Raising from the training loop (not killing the process) lets the MLflow run be marked FAILED and Prefect
    record the error. When the flag trips, the thread logs every thread's stack at once, so a step hung in
    native code (where Python cannot interrupt it) still says where it hangs, and `on_stall` runs (it
    pushes a stalled gauge). Collectives in a distributed run are bounded by torch.distributed's own timeout.
    """

    def __init__(self, timeout_s: float, total_steps: int, on_stall: Callable[[], None] | None = None):
        self.timeout_s, self.total_steps, self.on_stall = timeout_s, total_steps, on_stall
        self._last = time.monotonic()
        self._last_step = 0
        self._stop = threading.Event()
        self.stalled_after: float | None = None

    def beat(self, completed_steps: int | None = None) -> None:
        """Progress: a step (or a checkpoint write) completed."""
        self._last = time.monotonic()
        if completed_steps is not None:
            self._last_step = completed_steps

    def check(self) -> None:
        """Raise TrainingStalled if the watchdog tripped."""
        if self.stalled_after is not None:
            raise TrainingStalled(
                f"distill: no optimizer step completed for {self.stalled_after:.3g} s (distill.stall_timeout_s={self.timeout_s:g}); "
                f"{self._last_step} of {self.total_steps} steps were done. Training was stopped instead of hanging. If steps are "
                "legitimately this slow (a cold device, long sequences on a CPU, a big checkpoint write), raise distill.stall_timeout_s; "
                "otherwise see the stack logged with 'distill stalled' for what hangs (data, a collective, the device)."
            )

    def _watch(self) -> None:
        while not self._stop.is_set():
            waited = time.monotonic() - self._last
            if waited >= self.timeout_s:
                self.stalled_after = waited
                # the training thread (Prefect may run a task off the main thread)
                frame = sys._current_frames().get(self._trainer)
                stack = "".join(traceback.format_stack(frame)) if frame else "(training thread not found)"
                logger.error("distill stalled: no step for %.3g s (stall_timeout_s=%g); training thread at:\n%s", waited, self.timeout_s, stack)
                if self.on_stall:
                    try:
                        self.on_stall()
                    except Exception as e:  # noqa: BLE001 - reporting the stall must not hide it
                        logger.warning("stall report failed: %s", e)
                return
            self._stop.wait(self.timeout_s - waited)

    def __enter__(self) -> StallWatchdog:
        self._last = time.monotonic()
        self._trainer = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="distill-stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class GaugePusher:
    """Training gauges pushed to a Prometheus Pushgateway (job "edgeflow-distill", grouped by run)."""

    JOB = "edgeflow-distill"

    def __init__(self, url: str, run: str):
        from prometheus_client import CollectorRegistry, Gauge

        self.url, self.grouping = url, {"run": run}
        self.registry = CollectorRegistry()
        g = lambda name, doc: Gauge(f"edgeflow_distill_{name}", doc, registry=self.registry)  # noqa: E731
        self.step = g("step", "Optimizer steps completed.")
        self.loss = g("loss", "Total distillation loss of the last step.")
        self.tokens_per_s = g("tokens_per_second", "Training tokens per second over the last step.")
        self.last_step_ts = g("last_step_timestamp_seconds", "Unix time the last optimizer step completed.")
        self.stalled = g("stalled", "1 when the stall watchdog tripped.")
        if torch.cuda.is_available():
            self.gpu_util = g("gpu_utilization_percent", "GPU utilisation (nvml), device 0.")
            self.gpu_mem = g("gpu_memory_allocated_bytes", "Bytes allocated by torch on the current CUDA device.")
        else:
            self.rss = g("process_rss_bytes", "Resident memory of the training process.")
        self._failures = 0

    def push(self, step: int | None = None, loss: float | None = None, tokens_per_s: float | None = None) -> bool:
        """Set the gauges and push them; a failed push is logged, not raised (telemetry never stops training)."""
        from prometheus_client import push_to_gateway

        if step is not None:
            self.step.set(step)
            self.last_step_ts.set(time.time())
        if loss is not None:
            self.loss.set(loss)
        if tokens_per_s is not None:
            self.tokens_per_s.set(tokens_per_s)
        if torch.cuda.is_available():
            try:
                self.gpu_util.set(torch.cuda.utilization())
            except Exception:  # noqa: BLE001 - utilisation needs nvml; memory is still reported
                pass
            self.gpu_mem.set(torch.cuda.memory_allocated())
        else:
            import psutil

            self.rss.set(psutil.Process().memory_info().rss)
        try:
            push_to_gateway(self.url, job=self.JOB, registry=self.registry, grouping_key=self.grouping, timeout=10)
            self._failures = 0
            return True
        except Exception as e:  # noqa: BLE001
            self._failures += 1
            if self._failures in (1, 10, 100):
                logger.warning("push to Pushgateway %s failed (%d in a row): %s", self.url, self._failures, e)
            return False

    def mark_stalled(self) -> None:
        self.stalled.set(1)
        self.push()


# -------------------------------------------------------------------------------------------- training


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


def _find_checkpoint(checkpoint_dir: Path | None, world: int) -> tuple[int, Path] | None:
    """The newest checkpoint, as rank 0 found it: every process resumes from the same one."""
    found = latest_checkpoint(checkpoint_dir) if checkpoint_dir and _rank_world()[0] == 0 else None
    if world > 1 and checkpoint_dir:
        import torch.distributed as dist

        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    return found


def _gather_rng(world: int) -> list[dict]:
    """Every process's RNG state (collective), so each resumes its own stream."""
    if world == 1:
        return [_rng_state()]
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, _rng_state())
    return out


def train(teacher, student, data: TokenDataset | list[list[int]], cfg: DistillConfig, pad_id: int, *,
          layer_map: dict[int, int] | None = None, checkpoint_dir: Path | None = None, run_label: str = "local",
          log: LogFn | None = None, zero_config: dict | None = None) -> DistillResult:
    """Run the distillation loop; `log(step, metrics)` receives each step's kd, ce, hidden_mse, total, lr and tokens_per_s.

    Resumes from the newest checkpoint in checkpoint_dir (if any) and writes one every cfg.checkpoint_every steps.
    Under an initialized torch.distributed process group (tasks/distill_launch.py) every process runs this loop on its
    share of each step's batch, with DistributedDataParallel, or a DeepSpeed ZeRO engine when zero_config (a DeepSpeed
    config dict) is given; the logged terms are the whole step's, and only rank 0 logs, pushes gauges and writes
    checkpoints (a ZeRO engine's shards are written by every process).
    """
    check_teacher_frozen(teacher)
    check_no_shared_storage(teacher, student)
    if cfg.beta > 0 and not layer_map:
        raise ValueError("distill.beta > 0 needs a teacher->student layer map (resolve_layer_map)")
    rank, world = _rank_world()
    if zero_config is not None and world == 1:
        raise ValueError("a DeepSpeed ZeRO engine needs an initialized torch.distributed process group; run through "
                         "tasks.distill_launch (distill.processes > 1), or train without zero_config")
    is_main = rank == 0
    log = log if is_main else None
    use_hidden = cfg.beta > 0
    device = next(student.parameters()).device
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

    found = _find_checkpoint(checkpoint_dir, world)
    if found:
        _, state_file = found
        # our own file under the profile's work dir; it holds RNG tuples and numpy arrays, hence weights_only=False
        state = torch.load(state_file, map_location=device, weights_only=False)
        if state["data"]["samples"] != len(data) or state["data"]["batch_size"] != cfg.batch_size:
            raise RuntimeError(f"checkpoint {state_file} was written for another training set or batch size; delete {checkpoint_dir}")
        # a torch checkpoint holds whole tensors (any process count resumes it); a ZeRO one holds one shard per process
        written_by = state.get("engine", {"format": "torch", "world_size": 1})
        if written_by["format"] != engine.format or (engine.format == "deepspeed" and written_by["world_size"] != world):
            names = {"torch": "plain torch (one process or ddp)", "deepspeed": "deepspeed-zero3"}
            raise RuntimeError(
                f"checkpoint {state_file} was written by a {names[written_by['format']]} run of {written_by['world_size']} "
                f"process(es); this run is {names[engine.format]} with {world}. Resume it with the distill.strategy and "
                f"distill.processes it was written with, or delete {checkpoint_dir} to start over"
            )
        engine.load(state, state_file.parent)
        _set_rng_state(_rank_rng(state, rank, world))
        history, tokens, train_s, start = state["history"], state["tokens"], state["train_s"], state["data"]["next_step"]
        logger.info("resumed from step %d (%s)", start, state_file.parent)
        if is_main:
            print(f"distill: resumed from step {start} ({state_file.parent})")
        if log:
            log(start, {"resumed_from_step": float(start)})

    pusher = GaugePusher(cfg.pushgateway_url, run_label) if cfg.pushgateway_url and is_main else None
    watchdog = StallWatchdog(cfg.stall_timeout_s, cfg.steps, pusher.mark_stalled if pusher else None)
    with watchdog:
        watchdog.beat(start)
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            batch = [data[i] for i in order.indices(step, rank, world)]
            input_ids, attn, labels = (x.to(device) for x in collate(batch, pad_id))
            watchdog.check()
            check_teacher_frozen(teacher)  # every step: a callback or hook must not unfreeze it mid-run
            with torch.no_grad():
                t_out = teacher(input_ids=input_ids, attention_mask=attn, output_hidden_states=use_hidden, use_cache=False)
            logits, s_hidden = engine.module(input_ids, attn, use_hidden)
            sums = StepSums(*kd_sums(logits, t_out.logits, labels, cfg.temperature))
            if use_hidden:
                sums.sse, sums.tsq, _ = hidden_sums(s_hidden, _hidden(t_out, t_layers), attn)
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
            if checkpoint_dir and cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
                rngs = _gather_rng(world)
                engine.save(checkpoint_dir, done, {
                    "rng": rngs[0], "rng_ranks": rngs, "engine": {"format": engine.format, "world_size": world},
                    "data": {"next_step": done, "samples": len(data), "batch_size": cfg.batch_size, "seed": cfg.seed},
                    "history": history, "tokens": tokens, "train_s": train_s,
                }, is_main)
                written.append(done)
                watchdog.beat()
    engine.finish()
    if cfg.gradient_checkpointing:
        student.gradient_checkpointing_disable()
    student.eval()
    return DistillResult(
        steps=cfg.steps,
        final_loss=history[-1]["total"] if history else float("nan"),
        history=history,
        tokens_per_s=tokens / max(train_s, 1e-9),
        teacher_params=_count(teacher),
        student_params=_count(student),
        resumed_from_step=start,
        checkpoints_written=written,
        processes=world,
    )


# ------------------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def compare_to_teacher(teacher, student, seqs: list[list[int]]) -> dict[str, float]:
    """Held-out top-1 agreement of student with teacher, mean KL(teacher ‖ student), and both perplexities."""
    agree = total = 0
    nll_t = nll_s = kl = 0.0
    device = next(student.parameters()).device
    for s in seqs:
        ids = torch.tensor([s], device=device)
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


def load_tokenizer(teacher_dir: Path, student_from: Path | None = None):
    """The teacher's tokenizer, after checking that student_from's is the same one (no model is loaded)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    if student_from is not None:
        try:
            student_tok = AutoTokenizer.from_pretrained(student_from)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"distill.student_from={student_from} has no readable tokenizer ({e}); save the tokenizer the student was made "
                "with next to its config (tokenizer.save_pretrained) so it can be checked against the teacher's"
            ) from None
        check_same_tokenizer(tokenizer, student_tok, teacher_dir, student_from)
    return tokenizer


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


def prepare_run(teacher_dir: Path, cfg: DistillConfig, corpora: list[Path], eval_texts: list[str], work_dir: Path,
                student_from: Path | None = None, log: LogFn | None = None) -> PreparedRun:
    """Checks that need no training (tokenizers, vocabularies, frozen teacher, memory budget, size ratio), then the
    models (on the CPU) and the training set (built once, cached by content)."""
    from transformers import AutoModelForCausalLM

    log = log or (lambda step, metrics: None)
    tokenizer = load_tokenizer(teacher_dir, student_from)
    torch.manual_seed(cfg.seed)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    teacher.requires_grad_(False)
    teacher.eval()
    check_vocab(teacher, tokenizer, "teacher")
    student, kept = build_student(teacher, cfg, student_from)
    if student.config.vocab_size != teacher.config.vocab_size:
        raise ValueError(
            f"distill.student_from={student_from}: the student's vocab_size {student.config.vocab_size} != the teacher's "
            f"{teacher.config.vocab_size}; logit distillation needs the same output vocabulary (the teacher's tokenizer)"
        )
    layer_map = resolve_layer_map(cfg, teacher.config.num_hidden_layers, student.config.num_hidden_layers, kept) if cfg.beta > 0 else None
    d_s, d_t = student.config.hidden_size, teacher.config.hidden_size
    n_proj = len(layer_map) * d_s * d_t if layer_map and d_s != d_t else 0
    n_teacher, n_student = _count(teacher), _count(student)
    memory_mb = check_memory_budget(sum(p.numel() for p in student.parameters() if p.requires_grad) + n_proj, cfg)
    ratio = param_ratio(n_teacher, n_student)
    check_teacher_frozen(teacher)
    check_no_shared_storage(teacher, student)
    checks = {"teacher_params": n_teacher, "student_params": n_student, "size_ratio": ratio,
              "param_ratio_in_guideline": float(PARAM_RATIO_GUIDELINE[0] <= ratio <= PARAM_RATIO_GUIDELINE[1]),
              "student_training_memory_mb": memory_mb, "student_layers": student.config.num_hidden_layers}
    log(0, checks)

    data, data_stats = prepare_dataset(corpora, tokenizer, cfg, work_dir / "cache" / "distill-data")
    log(0, {k: v for k, v in data_stats.items() if k != "dataset_key"})
    held_out, _ = tokenize_corpus(eval_texts, tokenizer, cfg.max_seq_len)
    if not held_out:
        raise ValueError("no held-out evaluation text of 2+ tokens; check gate.eval_sources")
    run_key = distill_run_key(teacher_dir, student_from, cfg, data_stats["dataset_key"])
    return PreparedRun(tokenizer, teacher, student, layer_map, checks, data, data_stats, held_out, run_key,
                       checkpoint_root(work_dir, run_key))


def finish_run(run: PreparedRun, before: dict[str, float], result: DistillResult, out_dir: Path) -> dict:
    """Evaluate the trained student against the teacher, save it (with the tokenizer and a manifest) to out_dir,
    drop the run's checkpoints, and return run_distill's metrics."""
    after = compare_to_teacher(run.teacher, run.student, run.held_out)
    run.student.to("cpu")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
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
        **run.checks,
        **{k: v for k, v in run.data_stats.items() if k != "dataset_key"},
        "history": result.history,
    }


def run_distill(teacher_dir: Path, cfg: DistillConfig, corpora: list[Path], eval_texts: list[str], out_dir: Path,
                work_dir: Path, student_from: Path | None = None, log: LogFn | None = None) -> dict:
    """Checks → training set → train (resumable) → evaluate → save, in this process. Returns metrics; the student
    lands in out_dir. tasks/distill_launch.py:run_distill_distributed is the same over several processes."""
    run = prepare_run(teacher_dir, cfg, corpora, eval_texts, work_dir, student_from, log)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run.teacher.to(device)
    run.student.to(device)
    before = compare_to_teacher(run.teacher, run.student, run.held_out)
    result = train(run.teacher, run.student, run.data, cfg, run.tokenizer.pad_token_id, layer_map=run.layer_map,
                   checkpoint_dir=run.checkpoint_dir, run_label=run.run_key[:12], log=log)
    return finish_run(run, before, result, out_dir)
