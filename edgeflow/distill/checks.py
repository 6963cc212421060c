"""Checks before any training compute: teacher and student share one tokenizer (load_tokenizer, check_same_tokenizer),
every token id has an embedding row (check_vocab), the teacher is frozen and shares no storage with the student, the
training memory estimate fits distill.memory_budget_mb, and the teacher/student size ratio (a warning, never a failure).
"""
from __future__ import annotations

import hashlib
import json
import logging
import warnings
from pathlib import Path

from edgeflow.profile import DistillConfig

logger = logging.getLogger("edgeflow.distill")

# The field's guideline for a distilled student's size: 5-10x fewer parameters than its teacher.
PARAM_RATIO_GUIDELINE = (5.0, 10.0)
# fp32 weights + fp32 gradients + AdamW's two fp32 moments.
TRAINING_BYTES_PER_PARAM = 16


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
