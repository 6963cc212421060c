"""Consistency gate: each variant's built engine against the full-precision reference.

Tiny CPU run: python -m flows.consistency --profile configs/test-tiny.yaml
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from tasks.calibration import allocate
from tasks.config import GateConfig
from tasks.engines import get_backend
from tasks.evaluation.metrics import Accumulator, LayerError, greedy_exact_match, log_softmax
from tasks.textdata import load_texts


def eval_texts(sources: dict[str, Path], num: int, tokenizer) -> list[str]:
    """Up to `num` held-out texts, spread evenly over the domains, in a fixed order."""
    per = allocate({d: 1.0 for d in sources}, num)
    out: list[str] = []
    for domain in sorted(sources):
        out += load_texts([sources[domain]], tokenizer)[: per[domain]]
    return out


def tokenize(texts: list[str], tokenizer, max_tokens: int) -> list[list[int]]:
    """Token ids, truncated to max_tokens; sequences of fewer than 2 tokens are dropped."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:max_tokens] for t in texts]
    return [x for x in ids if len(x) >= 2]


class HFScorer:
    """Teacher-forced logits from a transformers checkpoint: dense, or compressed-tensors as its fake-quantized twin."""

    def __init__(self, model_dir: Path):
        from tasks.quantize import load_dequantized

        self.model = load_dequantized(model_dir)

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> np.ndarray:
        return self.model(input_ids=torch.tensor([ids])).logits[0].float().numpy()

    @torch.no_grad()
    def with_hidden(self, ids: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits and every decoder layer's output hidden states ([len, hidden] each), from one forward pass."""
        out = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        return out.logits[0].float().numpy(), [h[0].float().numpy() for h in out.hidden_states[1:]]

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int, stop_token_ids: list[int]) -> list[int]:
        """Greedy continuation with a KV cache, stopping before a stop token (as the engines do)."""
        out: list[int] = []
        past, x = None, torch.tensor([ids])
        for _ in range(max_new_tokens):
            o = self.model(input_ids=x, past_key_values=past, use_cache=True)
            past, token = o.past_key_values, int(o.logits[0, -1].argmax())
            if token in stop_token_ids:
                break
            out.append(token)
            x = torch.tensor([[token]])
        return out


def greedy_prompts(seqs: list[list[int]], num: int) -> list[list[int]]:
    """Prompts for the greedy exact-match check: the first half (at most 64 tokens) of evaluation sequences, spread evenly."""
    step = max(1, len(seqs) // max(num, 1))
    picked = seqs[::step][:num]
    return [s[: max(2, min(len(s) // 2, 64))] for s in picked]


def measure_speed(backend, session, prompt_ids: list[int], n_tokens: int = 64) -> dict[str, float]:
    """Decode tok/s and time to first token of one greedy generation (no stop tokens)."""
    t0 = time.perf_counter()
    first = None
    count = 0
    for _ in backend.generate(session, prompt_ids, n_tokens, []):
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    decode = (count - 1) / (end - first) if count > 1 else 0.0
    return {"decode_tok_s": decode, "ttft_ms": 1000 * ((first or end) - t0), "speed_tokens": count}


def run_gate(
    reference_dir: Path,
    variants: list[dict],
    seqs: list[list[int]],
    gate: GateConfig,
    backend_name: str,
    speed_prompt: list[int],
    prompts: list[list[int]] | None = None,
    stop_token_ids: list[int] | None = None,
) -> tuple[list[dict], dict]:
    """Score every variant's engine (and its fake-quantized HF model) against the FP reference.

    `variants`: dicts with name, engine_dir, checkpoint_dir (the HF-loadable checkpoint the engine was built
    from), size_mb, quantized (bool). Sequences are scored one at a time for all models together, so
    no full logit tensor set is ever held in memory. `prompts` are continued greedily for
    `gate.greedy_tokens` tokens by the reference and by every engine (greedy exact match).
    Returns (rows, distributions): per-sequence agreement, per-token KL and per-layer hidden-state
    error per variant, for the plots.
    """
    backend = get_backend(backend_name)
    reference = HFScorer(reference_dir)
    sessions = {v["name"]: backend.load(Path(v["engine_dir"])) for v in variants}
    fakeq = {v["name"]: (HFScorer(Path(v["checkpoint_dir"])) if v["quantized"] else reference) for v in variants}
    vs_ref = {v["name"]: Accumulator() for v in variants}
    parity = {v["name"]: Accumulator() for v in variants}
    layer_error = {v["name"]: LayerError() for v in variants if v["quantized"]}
    for ids in seqs:
        ref_logits, ref_hidden = reference.with_hidden(ids)
        ref = log_softmax(ref_logits)
        for v in variants:
            eng = log_softmax(backend.score(sessions[v["name"]], ids))
            vs_ref[v["name"]].add_logprobs(ref, eng, ids)
            if fakeq[v["name"]] is reference:
                fq = ref
            else:
                fq_logits, fq_hidden = fakeq[v["name"]].with_hidden(ids)
                fq = log_softmax(fq_logits)
                layer_error[v["name"]].add(ref_hidden, fq_hidden)
            parity[v["name"]].add_logprobs(fq, eng, ids)

    prompts, stop = prompts or [], stop_token_ids or []
    ref_continuations = [reference.greedy(p, gate.greedy_tokens, stop) for p in prompts]
    rows = []
    for v in variants:
        m = vs_ref[v["name"]].result()
        m["engine_parity"] = parity[v["name"]].result()["top1_agreement"]
        eng_continuations = [list(backend.generate(sessions[v["name"]], p, gate.greedy_tokens, stop)) for p in prompts]
        m["greedy_exact_match"] = greedy_exact_match(ref_continuations, eng_continuations) if prompts else None
        m["greedy_prompts"] = len(prompts)
        m |= measure_speed(backend, sessions[v["name"]], speed_prompt)
        reasons = []
        if m["engine_parity"] < gate.min_engine_parity:
            reasons.append(
                f"engine fault: engine agrees with its own fake-quantized model on {m['engine_parity']:.1%} "
                f"of tokens (< {gate.min_engine_parity:.1%}); the conversion is wrong, not the quantization"
            )
        if m["top1_agreement"] < gate.min_top1_agreement:
            reasons.append(f"top-1 agreement {m['top1_agreement']:.2%} < {gate.min_top1_agreement:.2%}")
        if m["kl"] > gate.max_mean_kl:
            reasons.append(f"mean KL {m['kl']:.4f} > {gate.max_mean_kl}")
        if gate.min_greedy_exact_match is not None and (m["greedy_exact_match"] or 0.0) < gate.min_greedy_exact_match:
            reasons.append(
                f"greedy {gate.greedy_tokens}-token exact match {m['greedy_exact_match']:.1%} < {gate.min_greedy_exact_match:.1%}"
            )
        if m["ppl_increase"] > gate.max_ppl_increase:
            reasons.append(f"perplexity +{m['ppl_increase']:.1%} > +{gate.max_ppl_increase:.1%}")
        rows.append(
            {
                "name": v["name"],
                "size_mb": round(v["size_mb"], 1),
                "decode_tok_s": round(m["decode_tok_s"], 1),
                "ttft_ms": round(m["ttft_ms"], 1),
                "top1_agreement": round(m["top1_agreement"], 4),
                "kl": round(m["kl"], 5),
                "kl_p99": round(m["kl_p99"], 5),
                "top1_last": round(m["top1_agreement_last"], 4),
                "greedy_exact": None if m["greedy_exact_match"] is None else round(m["greedy_exact_match"], 4),
                "ppl": round(m["ppl"], 3),
                "passed": not reasons,
                "quantized": v["quantized"],
                "reasons": reasons,
                "metrics": m,
            }
        )
    distributions = {
        "seq_agreement": {n: a.seq_agreement for n, a in vs_ref.items()},
        "kl": {n: a.kl_values() for n, a in vs_ref.items()},
        "layer_error": {n: e.result() for n, e in layer_error.items()},
    }
    return rows, distributions
