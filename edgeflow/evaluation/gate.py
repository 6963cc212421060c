"""Consistency gate, engine half: each variant's built engine, on the host that built it, against the stored FP reference.

Tiny CPU run (services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml --deploy none

No torch here: the FP student's side was computed by edgeflow/evaluation/reference.py where torch runs.
"""
from __future__ import annotations

from pathlib import Path

from edgeflow.calibration.mix import allocate
from edgeflow.profile import GateConfig
from edgeflow.profile.slo import SLOTarget
from edgeflow.engines import generate_many, get_backend
from edgeflow.evaluation import service
from edgeflow.evaluation.service import measure_speed
from edgeflow.evaluation.answers import answer_prompts, ok_share, summary
from edgeflow.evaluation.metrics import Accumulator, greedy_exact_match, log_softmax
from edgeflow.evaluation.reference import Reference
from edgeflow.tracking.progress import LoopProgress
from edgeflow.calibration.textdata import load_texts


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


def greedy_prompts(seqs: list[list[int]], num: int) -> list[list[int]]:
    """Prompts for the greedy exact-match check: the first half (at most 64 tokens) of evaluation sequences, spread evenly."""
    step = max(1, len(seqs) // max(num, 1))
    picked = seqs[::step][:num]
    return [s[: max(2, min(len(s) // 2, 64))] for s in picked]


def served_speed(backend, session, prompt_ids: list[int], engine_dir: Path) -> dict[str, float | str]:
    """The speed a client of the server gets: decode tok/s and TTFT with the decoding settings the server applies by
    default (the engine's generation_config.json: its repetition penalty, temperature, top-p), and greedy beside them
    (decode_tok_s_greedy, ttft_ms_greedy). Without defaults the server decodes greedily and the two are one run."""
    from edgeflow.serving.runtime import generation_defaults
    from edgeflow.engines.sampling import SamplingParams
    from edgeflow.evaluation.answers import SEED

    measure_speed(backend, session, prompt_ids, n_tokens=8)  # warm-up: neither figure pays for the first call
    greedy = measure_speed(backend, session, prompt_ids)
    defaults = generation_defaults(engine_dir)
    served = measure_speed(backend, session, prompt_ids, sampling=SamplingParams(**defaults, seed=SEED)) if defaults else greedy
    return served | {"decode_tok_s_greedy": greedy["decode_tok_s"], "ttft_ms_greedy": greedy["ttft_ms"],
                     "decode_settings": ", ".join(f"{k} {v}" for k, v in sorted(defaults.items())) or "greedy"}


def variant_reasons(m: dict, gate: GateConfig, answers: list[dict]) -> list[str]:
    """Why one variant fails the gate, one line per missed threshold (empty: it passed). `m`: its measured figures
    (engine_parity, top1_agreement, kl, greedy_exact_match, ppl_increase); `answers`: its answers to the demo prompts
    (edgeflow/evaluation/answers.py). Answers that degenerate fail a variant whatever its KL."""
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
    if gate.min_answers_ok is not None and (share := ok_share(answers)) < gate.min_answers_ok:
        bad = sum(a["degenerate"] for a in answers)
        reasons.append(f"answers: {bad} of {len(answers)} demo answers degenerate, {share:.0%} not degenerate < "
                       f"{gate.min_answers_ok:.0%} (gate.min_answers_ok)")
    return reasons


def run_gate(reference: Reference, variants: list[dict], gate: GateConfig, backend_name: str,
             slo_targets: list[SLOTarget] | None = None, pool: str = "inline") -> tuple[list[dict], dict]:
    """Score every variant's engine, on this host, against the stored FP reference (edgeflow/evaluation/reference.py).

    `variants`: dicts with name, engine_dir, size_mb, quantized (bool). Sequences are scored one at a time for all
    engines together, so no full logit tensor set is ever held in memory. Each engine continues the reference's
    greedy prompts for `gate.greedy_tokens` tokens (greedy exact match), all in flight together (generate_many).
    Engine parity compares each engine with its own fake-quantized model's argmax, which the reference half stored.
    Each quantized variant is also measured against `slo_targets` (slo.targets) where this host stands for them
    (edgeflow/evaluation/service.py; `pool`: where this stage runs, placement.consistency): a missed objective fails
    the variant like a missed threshold, as an `slo <device>:` reason, and the row's `slo` holds the figures.
    Returns (rows, distributions): per-sequence agreement, per-token KL and per-layer hidden-state error per
    variant, for the plots.
    """
    backend = get_backend(backend_name)
    here, elsewhere = service.targets_here(list(slo_targets or []), backend_name, pool)
    sessions = {v["name"]: backend.load(Path(v["engine_dir"])) for v in variants}
    missing = [v["name"] for v in variants if v["quantized"] and v["name"] not in reference.fakeq_argmax]
    if missing:
        raise ValueError(f"the gate reference has no fake-quantized pass for {missing} (it has {sorted(reference.fakeq_argmax)}); "
                         "re-run gate-reference with the same checkpoints as build-engine")
    vs_ref = {v["name"]: Accumulator() for v in variants}
    parity = {v["name"]: [0, 0] for v in variants}  # [agreeing positions, positions]
    progress = LoopProgress(f"gate ({len(variants)} engines)", len(reference.seqs) + len(variants), "sequences")
    for i, ids in enumerate(reference.seqs):
        for v in variants:
            eng = log_softmax(backend.score(sessions[v["name"]], ids))
            vs_ref[v["name"]].add_top_k(reference.topk_ids[i], reference.topk_logp[i], reference.tail_logp[i],
                                        reference.target_logp[i], eng, ids)
            fq = reference.fakeq_argmax[v["name"]][i] if v["quantized"] else reference.argmax(i)
            parity[v["name"]][0] += int((fq[:-1] == eng[:-1].argmax(-1)).sum())
            parity[v["name"]][1] += len(ids) - 1
        progress.update(i + 1)

    prompts, stop, ref_continuations = reference.prompts, reference.stop_token_ids, reference.continuations
    speed_prompt = reference.speed_prompt
    rows = []
    for k, v in enumerate(variants, 1):
        m = vs_ref[v["name"]].result()
        m["engine_parity"] = parity[v["name"]][0] / max(parity[v["name"]][1], 1)
        eng_continuations = generate_many(backend, sessions[v["name"]], prompts, gate.greedy_tokens, stop)
        refused = [(p, e) for p, e in zip(prompts, eng_continuations) if isinstance(e, ValueError)]
        if refused:
            raise ValueError(f"engine {v['name']!r} refused greedy prompt {refused[0][0][:8]}…: {refused[0][1]}") from refused[0][1]
        m["greedy_exact_match"] = greedy_exact_match(ref_continuations, eng_continuations) if prompts else None
        m["greedy_prompts"] = len(prompts)
        m |= served_speed(backend, sessions[v["name"]], speed_prompt, Path(v["engine_dir"]))
        answers = answer_prompts(backend, sessions[v["name"]], Path(v["engine_dir"]))  # as the server would answer
        said = summary(answers)
        m["answers_degenerate"], m["answers_distinct_2"] = said["degenerate"], said["distinct_2_mean"]
        progress.update(len(reference.seqs) + k)  # its greedy continuations, speed and answers
        reasons = variant_reasons(m, gate, answers)
        quality_passed = not reasons
        slo = None
        if v["quantized"] and (here or elsewhere):  # the FP student is the yardstick, never served
            slo = service.check_targets(backend_name, Path(v["engine_dir"]), here, reference.seqs, sessions[v["name"]]) + elsewhere
            reasons += [f"slo {t['device']}: {miss}" for t in slo for miss in t.get("misses", [])]
        rows.append(
            {
                "name": v["name"],
                "size_mb": round(v["size_mb"], 1),
                "decode_tok_s": round(m["decode_tok_s"], 1),
                "ttft_ms": round(m["ttft_ms"], 1),
                "decode_tok_s_greedy": round(m.pop("decode_tok_s_greedy"), 1),
                "ttft_ms_greedy": round(m.pop("ttft_ms_greedy"), 1),
                "decode_settings": m.pop("decode_settings"),
                "top1_agreement": round(m["top1_agreement"], 4),
                "kl": round(m["kl"], 5),
                "kl_p99": round(m["kl_p99"], 5),
                "top1_last": round(m["top1_agreement_last"], 4),
                "greedy_exact": None if m["greedy_exact_match"] is None else round(m["greedy_exact_match"], 4),
                "ppl": round(m["ppl"], 3),
                "passed": not reasons,
                "quantized": v["quantized"],
                "reasons": reasons,
                "quality_passed": quality_passed,
                "slo": slo,
                "metrics": m,
                "greedy_continuations": [[int(t) for t in c] for c in eng_continuations],
                "answers": answers,
            }
        )
    distributions = {
        "seq_agreement": {n: a.seq_agreement for n, a in vs_ref.items()},
        "kl": {n: a.kl_values() for n, a in vs_ref.items()},
        "layer_error": reference.meta.get("layer_error", {}),
    }
    return rows, distributions
