"""The consistency gate's FP reference: computed once where torch runs, stored as an artifact, read on the device.

    python -c "from edgeflow.evaluation.reference import load_reference; r = load_reference('DIR'); print(r.meta)"

The gate compares each built engine with the full-precision student. An engine only runs where it was built
(a TensorRT engine on the Orin that built it), while the FP student needs torch. So the gate is split:
this half runs the FP student (and each quantized variant's fake-quantized twin) on the eval sequences
and writes what the engine half needs, and the engine half (edgeflow/evaluation/gate.py) scores the engines
on their device against it, without torch and without the checkpoints' FP weights.

What is stored, per eval sequence of L tokens:
- the FP student's top-k log-probabilities at every position (ids and values, k = gate.reference_top_k),
  sorted so column 0 is the argmax, the log of the mass outside them, and the log-probability of each next
  token (perplexity);
- each quantized variant's fake-quantized argmax at every position (engine parity);
and, per greedy prompt, the FP student's greedy continuation; plus the speed prompt, the stop tokens, and
each variant's per-layer hidden-state error (computed here: it needs both torch models).

KL from top-k: the engine half computes KL(FP ‖ engine) over the k reference tokens plus one bucket for the
rest of the vocabulary. That is the KL of the coarsened distributions: exact where the reference's top-k
holds all its mass, a lower bound otherwise (the log-sum inequality). `meta.tail_mass_mean` says how much
mass the bucket held; the report prints it beside the KL.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgeflow.evaluation.metrics import log_mass_outside

REFERENCE_ARRAYS = "reference.npz"
REFERENCE_META = "reference.json"
# Bumped when the stored arrays change meaning; the engine half refuses another format.
REFERENCE_FORMAT = 1


class HFScorer:
    """Teacher-forced logits from a transformers checkpoint: dense, or compressed-tensors as its fake-quantized twin.
    The model and its inputs live on `device` (the CPU, or CUDA: `edgeflow doctor --role a100`); outputs come back as numpy."""

    def __init__(self, model_dir: Path, device: str = "cpu"):
        from edgeflow.engines.checkpoint import load_dequantized

        self.device = device
        self.model = load_dequantized(model_dir)
        if device != "cpu":
            self.model.to(device)

    def _ids(self, ids: list[int]):
        import torch

        return torch.tensor([ids], device=self.device)

    def __call__(self, ids: list[int]) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.model(input_ids=self._ids(ids)).logits[0].float().cpu().numpy()

    def with_hidden(self, ids: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits and every decoder layer's output hidden states ([len, hidden] each), from one forward pass."""
        import torch

        with torch.no_grad():
            out = self.model(input_ids=self._ids(ids), output_hidden_states=True)
        return out.logits[0].float().cpu().numpy(), [h[0].float().cpu().numpy() for h in out.hidden_states[1:]]

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: list[int]) -> list[list[int]]:
        """Each prompt's greedy continuation, stopping before a stop token (as the engines do), all prompts decoded
        as one left-padded batch with a KV cache. One batched step reads the weights once for every prompt: 16 prompts
        x 32 tokens on the 30-layer teacher took 29-35 s one prompt at a time and 5.6-6.8 s as one batch (2-core AMD
        EPYC; BENCHMARKS.md#gate-batching). Padding is masked and each row keeps its own
        positions, so a row's tokens are its unbatched continuation's (tests/evaluation/test_reference.py)."""
        import torch

        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        x = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        stops, past = set(stop_token_ids), None
        with torch.no_grad():
            for _ in range(max_new_tokens):
                o = self.model(input_ids=x, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
                past, tokens = o.past_key_values, o.logits[:, -1].argmax(-1)
                for row in list(live):
                    token = int(tokens[row])
                    if token in stops:
                        live.remove(row)
                    else:
                        out[row].append(token)
                if not live:
                    break
                # finished rows keep decoding their last token (their output is no longer read): the batch stays whole
                x = tokens[:, None]
                mask = torch.cat([mask, mask.new_ones((len(prompts), 1))], dim=1)
                positions = positions[:, -1:] + 1
        return out


def top_k(logp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the k largest log-probabilities (ids int32, values float32), largest first, ties to the lower id
    (so column 0 is exactly numpy's argmax), and the log of the mass outside them (float32, -inf when none)."""
    k = min(k, logp.shape[-1])
    idx = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logp, idx, -1)
    order = np.lexsort((idx, -vals), axis=-1)
    idx, vals = np.take_along_axis(idx, order, -1), np.take_along_axis(vals, order, -1)
    return idx.astype(np.int32), vals.astype(np.float32), log_mass_outside(logp, idx).astype(np.float32)


@dataclass
class Reference:
    """What the engine half of the gate compares against (see the module docstring)."""

    seqs: list[list[int]]
    topk_ids: list[np.ndarray]
    topk_logp: list[np.ndarray]
    tail_logp: list[np.ndarray]
    target_logp: list[np.ndarray]
    fakeq_argmax: dict[str, list[np.ndarray]]
    prompts: list[list[int]]
    continuations: list[list[int]]
    speed_prompt: list[int]
    stop_token_ids: list[int]
    meta: dict = field(default_factory=dict)

    def argmax(self, i: int) -> np.ndarray:
        return self.topk_ids[i][:, 0]


def compute_reference(reference_dir: Path, quantized: dict[str, Path], seqs: list[list[int]], prompts: list[list[int]],
                      greedy_tokens: int, k: int, speed_prompt: list[int], stop_token_ids: list[int],
                      meta: dict | None = None, device: str = "cpu") -> Reference:
    """Run the FP student (and each quantized checkpoint's fake-quantized twin) over the eval sequences, on `device`."""
    from edgeflow.evaluation.metrics import LayerError, log_softmax
    from edgeflow.tracking.progress import LoopProgress

    reference = HFScorer(reference_dir, device)
    fakeq = {name: HFScorer(path, device) for name, path in quantized.items()}
    layer_error = {name: LayerError() for name in quantized}
    ids_k, lp_k, tails, targets, fq_arg = [], [], [], [], {name: [] for name in quantized}
    progress = LoopProgress(f"gate reference (FP + {len(fakeq)} fake-quantized)", len(seqs) + len(prompts), "sequences")
    for n, ids in enumerate(seqs, 1):
        logits, hidden = reference.with_hidden(ids)
        lp = log_softmax(logits)
        top_ids, top_lp, tail_lp = top_k(lp, k)
        ids_k.append(top_ids)
        lp_k.append(top_lp)
        tails.append(tail_lp)
        targets.append(lp[np.arange(len(ids) - 1), np.asarray(ids[1:])].astype(np.float32))
        for name, scorer in fakeq.items():
            fq_logits, fq_hidden = scorer.with_hidden(ids)
            fq_arg[name].append(fq_logits.argmax(-1).astype(np.int32))
            layer_error[name].add(hidden, fq_hidden)
        progress.update(n)
    continuations = reference.greedy(prompts, greedy_tokens, stop_token_ids)
    progress.update(len(seqs) + len(prompts))
    mass = np.exp(np.concatenate([t[:-1] for t in tails]).astype(np.float64)) if seqs else np.zeros(1)
    info = (meta or {}) | {
        "format": REFERENCE_FORMAT, "top_k": int(min(k, lp_k[0].shape[-1])) if lp_k else k,
        "vocab": int(logits.shape[-1]) if seqs else None,
        "tail_mass_mean": float(mass.mean()), "tail_mass_max": float(mass.max()),
        "eval_prompts": len(seqs), "eval_positions": sum(len(s) - 1 for s in seqs),
        "layer_error": {name: e.result() for name, e in layer_error.items()},
    }
    return Reference(seqs, ids_k, lp_k, tails, targets, fq_arg, prompts, continuations, speed_prompt, stop_token_ids, info)


def _ragged(parts: list, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate along axis 0 (token lists or [L, k] arrays), with each part's length."""
    lens = np.asarray([len(p) for p in parts], dtype=np.int64)
    flat = np.concatenate([np.asarray(p, dtype=dtype) for p in parts]) if parts else np.zeros(0, dtype=dtype)
    return flat, lens


def _split(flat: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(lens)[:-1]) if len(lens) else []


def save_reference(ref: Reference, out: Path) -> Path:
    """Write reference.npz (plain arrays, no pickles) and reference.json into `out`; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    arrays["seqs"], arrays["seq_lens"] = _ragged(ref.seqs)
    arrays["topk_ids"], _ = _ragged(ref.topk_ids, np.int32)
    arrays["topk_logp"], _ = _ragged(ref.topk_logp, np.float32)
    arrays["tail_logp"], _ = _ragged(ref.tail_logp, np.float32)
    arrays["target_logp"], _ = _ragged(ref.target_logp, np.float32)
    arrays["prompts"], arrays["prompt_lens"] = _ragged(ref.prompts)
    arrays["continuations"], arrays["continuation_lens"] = _ragged(ref.continuations)
    for i, name in enumerate(sorted(ref.fakeq_argmax)):
        arrays[f"fakeq_{i}"], _ = _ragged(ref.fakeq_argmax[name], np.int32)
    np.savez(out / REFERENCE_ARRAYS, **arrays)
    meta = ref.meta | {"fakeq_variants": sorted(ref.fakeq_argmax), "speed_prompt": list(map(int, ref.speed_prompt)),
                       "stop_token_ids": list(map(int, ref.stop_token_ids))}
    (out / REFERENCE_META).write_text(json.dumps(meta, indent=1))
    return out


def load_reference(path: Path) -> Reference:
    """Read what save_reference wrote; refuses another format, naming both."""
    path = Path(path)
    meta = json.loads((path / REFERENCE_META).read_text())
    if meta.get("format") != REFERENCE_FORMAT:
        raise ValueError(f"{path}: gate reference format {meta.get('format')}, this edgeflow reads {REFERENCE_FORMAT}; "
                         "re-run the gate-reference stage with this edgeflow")
    with np.load(path / REFERENCE_ARRAYS, allow_pickle=False) as z:
        a = {k: z[k] for k in z.files}
    lens = a["seq_lens"]
    return Reference(
        seqs=[s.tolist() for s in _split(a["seqs"], lens)],
        topk_ids=_split(a["topk_ids"], lens),
        topk_logp=_split(a["topk_logp"], lens),
        tail_logp=_split(a["tail_logp"], lens),
        target_logp=_split(a["target_logp"], lens - 1),
        fakeq_argmax={name: _split(a[f"fakeq_{i}"], lens) for i, name in enumerate(meta["fakeq_variants"])},
        prompts=[p.tolist() for p in _split(a["prompts"], a["prompt_lens"])],
        continuations=[c.tolist() for c in _split(a["continuations"], a["continuation_lens"])],
        speed_prompt=meta["speed_prompt"], stop_token_ids=meta["stop_token_ids"],
        meta={k: v for k, v in meta.items() if k not in ("speed_prompt", "stop_token_ids")},
    )
