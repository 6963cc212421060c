"""The student: which teacher layers a layer-dropped student keeps (keep_layers, every_kth, kept_layers), building it
from the teacher or from distill.student_from (build_student), which of its layers the hidden-state term matches to
the teacher's (resolve_layer_map), and counting a model's parameters (count_params).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from edgeflow.model.architecture import transformers_kwargs
from edgeflow.profile import DistillConfig
from edgeflow.distill.losses import check_layer_map, default_layer_map, spread_layer_map


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


# Training sequences the drop_block choice reads (the first ones of the training set, so every process and every retry
# of the same run chooses the same block).
BLOCK_PROBE_SEQS = 16


def block_distances(teacher, seqs: list[list[int]], size: int) -> dict[int, float]:
    """{first layer l: mean angular distance (0..1) between the residual stream entering layer l and leaving layer
    l + size - 1}, over every position of `seqs`, for each block that spares layer 0 and the last layer."""
    n = teacher.config.num_hidden_layers
    starts = range(1, n - size)
    if not starts:
        raise ValueError(f"distill.drop_block={size} leaves no block to drop in a {n}-layer teacher that keeps layer 0 and "
                         f"layer {n - 1}; use at most {n - 2}")
    sums = {l: 0.0 for l in starts}
    count = 0
    with torch.no_grad():
        for s in seqs:
            hs = teacher(input_ids=torch.tensor([s], device=next(teacher.parameters()).device), output_hidden_states=True,
                         use_cache=False).hidden_states  # hs[l]: the input of layer l
            for l in starts:
                cos = torch.nn.functional.cosine_similarity(hs[l][0].float(), hs[l + size][0].float(), dim=-1)
                sums[l] += float(torch.arccos(cos.clamp(-1, 1)).sum()) / torch.pi
            count += len(s)
    return {l: v / max(count, 1) for l, v in sums.items()}


def kept_layers(cfg: DistillConfig, n_layers: int, teacher=None, seqs: list[list[int]] | None = None) -> list[int]:
    """The teacher layers a layer-dropped student keeps: cfg.keep_layers, else all but cfg.drop_block's block (chosen
    on `teacher` over `seqs`), else every keep_every_k-th."""
    if cfg.drop_block is not None:
        if teacher is None or not seqs:
            raise ValueError("distill.drop_block chooses its block on the teacher over training sequences; none were given")
        d = block_distances(teacher, seqs[:BLOCK_PROBE_SEQS], cfg.drop_block)
        first = min(d, key=lambda l: (d[l], l))
        return [i for i in range(n_layers) if not first <= i < first + cfg.drop_block]
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


def build_student(teacher, cfg: DistillConfig, student_from: Path | None = None, seqs: list[list[int]] | None = None):
    """(student, kept teacher layers or None): a layer-dropped copy of the teacher, or the model at student_from
    (its checkpoint, or a fresh seeded init when the directory holds only a config.json). `seqs`: training sequences,
    which distill.drop_block reads to choose its block."""
    if student_from is None:
        kept = kept_layers(cfg, teacher.config.num_hidden_layers, teacher, seqs)
        return _freeze(keep_layers(teacher, kept), cfg), kept
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (student_from / "config.json").exists():
        raise FileNotFoundError(
            f"distill.student_from={student_from} has no config.json; point it at a saved model or config directory"
        )
    if _has_weights(student_from):
        student = AutoModelForCausalLM.from_pretrained(student_from, dtype=torch.float32, **transformers_kwargs(student_from))
    else:
        torch.manual_seed(cfg.seed)  # a config-only student is initialised the same way on every (re)run
        student = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(student_from), dtype=torch.float32,
                                                   **transformers_kwargs(student_from))
    student.requires_grad_(True)
    return _freeze(student, cfg), None


def _freeze(student, cfg: DistillConfig):
    """distill.freeze_embeddings: the input embedding (and a head tied to it, the same tensor) takes no gradient."""
    if cfg.freeze_embeddings:
        student.get_input_embeddings().weight.requires_grad_(False)
    return student


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



def count_params(model) -> int:
    """Parameters of `model`, each stored tensor once."""
    # parameters() yields a tied tensor once: SmolLM2's embedding and lm_head count once, as they are stored
    return sum(p.numel() for p in model.parameters())
