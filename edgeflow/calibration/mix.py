"""Domain-mixed calibration set: sample sources by ratio, truncate, write Parquet with stats.

Tiny CPU run: python -m edgeflow.pipeline.calibrate --profile configs/test-tiny.yaml
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from edgeflow.calibration.textdata import load_texts, record_text


def load_pool(source: Path, tokenizer) -> tuple[list[str], dict | None]:
    """Texts of one calibration source: a file, or a directory of edge-server access logs (cleaned first)."""
    if Path(source).is_dir():
        from dataclasses import asdict

        from edgeflow.calibration.access_logs import ingest, log_files

        records, report = ingest(log_files(source))
        return [record_text(r, tokenizer) for r in records], asdict(report)
    return load_texts([source], tokenizer), None


def allocate(ratios: dict[str, float], total: int) -> dict[str, int]:
    """Split `total` by ratio with the largest-remainder method (counts sum exactly to total)."""
    weight = sum(ratios.values())
    exact = {k: total * v / weight for k, v in ratios.items()}
    counts = {k: int(x) for k, x in exact.items()}
    short = total - sum(counts.values())
    for k in sorted(exact, key=lambda k: (-(exact[k] - counts[k]), k))[:short]:
        counts[k] += 1
    return counts


def sample_domain(pool: list[str], n: int, rng: random.Random) -> tuple[list[int], int]:
    """n indices into pool: shuffled passes without replacement; returns (indices, repeats beyond one pass)."""
    if not pool and n:
        raise ValueError("a calibration source with a positive ratio is empty; remove it from ratios or add data")
    out: list[int] = []
    while len(out) < n:
        out += rng.sample(range(len(pool)), len(pool))
    return out[:n], max(0, n - len(pool))


def build_calibration_set(
    sources: dict[str, Path], ratios: dict[str, float], total: int, max_tokens: int, seed: int, tokenizer, out_path: Path
) -> dict:
    """Write the calibration Parquet (domain, text, input_ids, n_tokens, truncated) and return its stats."""
    rng = random.Random(seed)
    counts = allocate({k: v for k, v in ratios.items() if v > 0}, total)
    rows: list[dict] = []
    repeats: dict[str, int] = {}
    ingest_reports: dict[str, dict] = {}
    for domain in sorted(counts):
        pool, ingest_report = load_pool(sources[domain], tokenizer)
        if ingest_report:
            ingest_reports[domain] = ingest_report
        idx, repeats[domain] = sample_domain(pool, counts[domain], rng)
        for i in idx:
            ids = tokenizer(pool[i], add_special_tokens=False)["input_ids"]
            rows.append(
                {
                    "domain": domain,
                    "source_index": i,
                    "text": pool[i],
                    "input_ids": ids[:max_tokens],
                    "n_tokens": min(len(ids), max_tokens),
                    "truncated": len(ids) > max_tokens,
                }
            )
    rng.shuffle(rows)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out_path)
    lengths = np.array([r["n_tokens"] for r in rows])
    return {
        "total": len(rows),
        "counts": {d: sum(r["domain"] == d for r in rows) for d in sorted(counts)},
        "repeated_samples": repeats,
        "truncated": int(sum(r["truncated"] for r in rows)),
        "token_length": {f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)} | {"max": int(lengths.max())},
        "total_tokens": int(lengths.sum()),
        "access_log_ingest": ingest_reports,
    }


_WORD = re.compile(r"\w+")


def _shingles(text: str, n: int) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def find_overlap(calib: list[str], evals: list[str], n: int = 8, threshold: float = 0.5) -> list[dict]:
    """Eval items that appear in the calibration texts: exact matches, or whose n-gram shingles are covered above threshold."""
    calib_norm = {" ".join(_WORD.findall(t.lower())) for t in calib}
    calib_sh: set[tuple[str, ...]] = set().union(*(_shingles(t, n) for t in calib)) if calib else set()
    hits = []
    for i, e in enumerate(evals):
        if " ".join(_WORD.findall(e.lower())) in calib_norm:
            hits.append({"eval_index": i, "kind": "exact", "overlap": 1.0, "text": e[:160]})
            continue
        sh = _shingles(e, n)
        if sh:
            frac = len(sh & calib_sh) / len(sh)
            if frac > threshold:
                hits.append({"eval_index": i, "kind": f"{n}-gram", "overlap": round(frac, 3), "text": e[:160]})
    return hits


class LeakageError(ValueError):
    """The calibration set overlaps the evaluation set."""


def check_no_leakage(calib: list[str], evals: list[str], n: int = 8, threshold: float = 0.5) -> None:
    """Fail naming the overlapping examples: calibrating on the eval set inflates every gate metric."""
    hits = find_overlap(calib, evals, n, threshold)
    if hits:
        listing = "\n".join(f"  eval[{h['eval_index']}] ({h['kind']}, {h['overlap']:.0%}): {h['text']!r}" for h in hits[:10])
        raise LeakageError(
            f"{len(hits)} evaluation item(s) overlap the calibration set; remove them from one side "
            f"(or point gate.eval_sources at held-out data):\n{listing}"
        )
