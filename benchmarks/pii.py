"""PII scrubbing: recall on planted secrets, false positives, and time per request (edgeflow/pii/).

    python benchmarks/pii.py [--fixture data/pii/planted.jsonl] [--requests 300] [--json OUT.json]

Prints, as markdown:
  * the CPU (model name from /proc/cpuinfo, avx2/avx512f flags) and library versions;
  * recall by kind, by region and by written format over the planted records: a secret counts as found
    when its exact string is absent from the scrubbed text; "typed" = the placeholder of its kind is there;
  * false positives: decoy records (secret-looking non-secrets) with any replacement or a `keep` string
    lost, by decoy type; replacements in the project's clean text (data/corpora/*.jsonl, data/eval/*.jsonl);
  * the same phone numbers under each libphonenumber leniency, and with bare digits (no "+", separator or
    leading 0) replaced only next to a word saying "phone";
  * time per request, p50/p99 µs: each fixture record; synthetic ~200-word, 3-message chat requests built
    from data/corpora/chat.jsonl (as is; with numbers such as years and prices; with one phone number and
    one email), through `scrub_value` as the server calls it; and with region pruning off.
"""
from __future__ import annotations

import argparse
import glob
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import phonenumbers  # noqa: E402
import stdnum  # noqa: E402
from phonenumbers import Leniency  # noqa: E402

from edgeflow.pii import KINDS, Scrubber, scrub, scrub_value  # noqa: E402

LABEL_PLACEHOLDER = {"phone": "[PHONE]", "national_id": "[NATIONAL_ID]", "iban": "[IBAN]", "card": "[CARD]",
                     "email": "[EMAIL]", "api_key": "[API_KEY]", "token": "[TOKEN]"}
CLEAN_GLOBS = ("data/corpora/*.jsonl", "data/eval/*.jsonl")


def cpu() -> tuple[str, str]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return model, " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f"))


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.1f}%)" if b else "0/0"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def recall(records: list[dict], run: Callable[[str], tuple[str, dict]]) -> dict:
    by: dict[str, dict[str, list[int]]] = {"kind": defaultdict(lambda: [0, 0, 0]), "region": defaultdict(lambda: [0, 0, 0]),
                                           "format": defaultdict(lambda: [0, 0, 0]), "type": defaultdict(lambda: [0, 0, 0])}
    misses = []
    for r in records:
        if r["decoy"]:
            continue
        out, _ = run(r["text"])
        for s in r["secrets"]:
            found = s["value"] not in out
            typed = found and LABEL_PLACEHOLDER[s["kind"]] in out
            keys = {"kind": s["kind"], "region": s["region"] or "-", "format": f"{s['kind']}/{s['format']}", "type": s["type"]}
            for axis, key in keys.items():
                cell = by[axis][key]
                cell[0] += 1
                cell[1] += found
                cell[2] += typed
            if not found:
                misses.append(f"{r['id']} {s['type']} {s['region']} {s['format']} {s['value']!r}: {r['text']}")
    return {"by": by, "misses": misses}


def decoy_fp(records: list[dict], run: Callable[[str], tuple[str, dict]]) -> dict:
    per_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    hits = []
    for r in records:
        if not r["decoy"]:
            continue
        out, found = run(r["text"])
        bad = bool(found) or any(k not in out for k in r["keep"])
        group = "near_miss" if r["decoy_type"].startswith("near_miss") else r["decoy_type"]
        per_type[group][0] += 1
        per_type[group][1] += bad
        if bad:
            hits.append(f"{r['id']} {r['decoy_type']} {found}: {r['text']} -> {out}")
    return {"per_type": per_type, "hits": hits}


def clean_fp(run: Callable[[str], tuple[str, dict]]) -> dict:
    n_strings = n_words = 0
    replaced: dict[str, int] = defaultdict(int)
    examples = []
    for pattern in CLEAN_GLOBS:
        for path in sorted(glob.glob(str(ROOT / pattern))):
            for rec in load(Path(path)):
                for s in strings(rec):
                    n_strings += 1
                    n_words += len(s.split())
                    out, found = run(s)
                    for k, v in found.items():
                        replaced[k] += v
                    if found and len(examples) < 10:
                        examples.append(f"{Path(path).relative_to(ROOT)}: {found}: {s[:160]!r}")
    return {"strings": n_strings, "words": n_words, "replaced": dict(replaced), "examples": examples}


def synthetic_requests(n: int, seed: int = 7) -> dict[str, list[dict]]:
    """~200-word 3-message chat requests from the project's chat corpus; plain, with numbers, with PII."""
    rng = random.Random(seed)
    texts = [m["content"] for rec in load(ROOT / "data/corpora/chat.jsonl") for m in rec["messages"]]
    numbers = ["in 2024", "$1,299", "about 365 days", "version 3.12", "at 14:30", "1.5 kg", "20%", "x 1,024"]
    pii = ["call me on +44 7400 123456", "my mobile is 0151 23456789", "mail jane.doe@example.com", "ring (415) 555-0199"]

    def request(extra: list[str]) -> dict:
        msgs, words = [], 0
        for role in ("user", "assistant", "user"):
            words_left = max(20, 200 - words) // (3 - len(msgs))
            parts, count = [], 0
            while count < words_left:
                t = rng.choice(texts).split()
                parts += t[: words_left - count]
                count = len(parts)
            msgs.append({"role": role, "content": " ".join(parts)})
            words += count
        for e in extra:
            m = rng.choice(msgs)
            w = m["content"].split()
            w.insert(rng.randrange(len(w)), e)
            m["content"] = " ".join(w)
        return {"messages": msgs, "response": None}

    return {
        "plain": [request([]) for _ in range(n)],
        "numbers": [request(rng.sample(numbers, 4)) for _ in range(n)],
        "one phone + one email": [request([rng.choice(pii[:2] + pii[3:]), pii[2]]) for _ in range(n)],
    }


def timed(fn: Callable[[Any], Any], items: list[Any], repeat: int) -> dict[str, float]:
    for it in items[:20]:
        fn(it)  # warm: libphonenumber loads a region's metadata on first use
    samples = []
    for _ in range(repeat):
        for it in items:
            t0 = time.perf_counter()
            fn(it)
            samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    return {"n": len(samples), "p50_us": statistics.median(samples), "p99_us": samples[int(0.99 * (len(samples) - 1))],
            "mean_us": statistics.fmean(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", type=Path, default=ROOT / "data/pii/planted.jsonl")
    ap.add_argument("--requests", type=int, default=300, help="synthetic chat requests per variant")
    ap.add_argument("--repeat", type=int, default=3, help="timing passes over each set")
    ap.add_argument("--json", type=Path, help="also write every number as JSON here")
    a = ap.parse_args()

    import_ms = float(subprocess.run(
        [sys.executable, "-c", "import time; t = time.perf_counter(); import edgeflow.pii; print((time.perf_counter() - t) * 1e3)"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    t0 = time.perf_counter()
    scrub("warm up: +49 151 23456789")
    first_call_ms = (time.perf_counter() - t0) * 1e3
    records = load(a.fixture)
    planted = [r for r in records if not r["decoy"]]
    model, flags = cpu()
    out: dict[str, Any] = {"cpu": model, "flags": flags, "python": platform.python_version(),
                           "phonenumbers": phonenumbers.__version__, "python-stdnum": stdnum.__version__}
    print(f"CPU: {model} ({flags}); Python {out['python']}, phonenumbers {out['phonenumbers']}, "
          f"python-stdnum {out['python-stdnum']}")
    print(f"Fixture: {a.fixture.relative_to(ROOT) if a.fixture.is_relative_to(ROOT) else a.fixture}: "
          f"{len(planted)} planted records ({sum(len(r['secrets']) for r in planted)} secrets), "
          f"{len(records) - len(planted)} decoys; {len(KINDS)} detector kinds\n")

    rec = recall(records, scrub)
    for axis in ("kind", "region"):
        rows = [[k, pct(v[1], v[0]), pct(v[2], v[0])] for k, v in sorted(rec["by"][axis].items())]
        print(f"### Recall by {axis}\n\n" + table([axis, "found (secret gone)", "typed (right placeholder)"], rows) + "\n")
    rows = [[k, pct(v[1], v[0])] for k, v in sorted(rec["by"]["format"].items())]
    print("### Recall by written format\n\n" + table(["kind/format", "found"], rows) + "\n")
    total = [sum(v[i] for v in rec["by"]["kind"].values()) for i in range(3)]
    print(f"All planted secrets: found {pct(total[1], total[0])}, typed {pct(total[2], total[0])}\n")
    if rec["misses"]:
        print("Missed:\n" + "\n".join(f"- {m}" for m in rec["misses"]) + "\n")
    out["recall"] = {axis: {k: {"n": v[0], "found": v[1], "typed": v[2]} for k, v in d.items()}
                     for axis, d in rec["by"].items()}
    out["misses"] = rec["misses"]

    fp = decoy_fp(records, scrub)
    rows = [[k, v[0], v[1]] for k, v in sorted(fp["per_type"].items())]
    n_decoys = sum(v[0] for v in fp["per_type"].values())
    n_bad = sum(v[1] for v in fp["per_type"].values())
    print(f"### False positives on decoys: {pct(n_bad, n_decoys)} records touched\n\n"
          + table(["decoy type", "records", "touched"], rows) + "\n")
    if fp["hits"]:
        print("Touched decoys:\n" + "\n".join(f"- {h}" for h in fp["hits"]) + "\n")
    clean = clean_fp(scrub)
    print(f"### Project clean text ({', '.join(CLEAN_GLOBS)}): {clean['strings']} strings, {clean['words']} words, "
          f"replacements: {sum(clean['replaced'].values())} {clean['replaced'] or ''}\n")
    for e in clean["examples"]:
        print(f"- {e}")
    out["decoys"] = {k: {"records": v[0], "touched": v[1]} for k, v in fp["per_type"].items()}
    out["decoy_hits"] = fp["hits"]
    out["clean"] = clean

    variants = [("VALID (default)", Scrubber()), ("POSSIBLE", Scrubber(leniency=Leniency.POSSIBLE)),
                ("STRICT_GROUPING", Scrubber(leniency=Leniency.STRICT_GROUPING)),
                ("EXACT_GROUPING", Scrubber(leniency=Leniency.EXACT_GROUPING)),
                ("VALID, bare digits only next to a phone word", Scrubber(bare_phone_needs_word=True))]
    rows = []
    out["phone_variants"] = {}
    for name, s in variants:
        r = recall(records, s.scrub)["by"]["kind"]["phone"]
        d = decoy_fp(records, s.scrub)["per_type"]
        c = clean_fp(s.scrub)["replaced"]
        touched = sum(v[1] for v in d.values())
        rows.append([name, pct(r[1], r[0]), pct(touched, n_decoys), c.get("phone", 0)])
        out["phone_variants"][name] = {"phone_found": r[1], "phones": r[0], "decoys_touched": touched, "clean_phone": c.get("phone", 0)}
    print("\n### Phone numbers by matcher setting\n\n"
          + table(["setting", "planted phones found", "decoys touched (any kind)", "clean-text phone replacements"], rows)
          + "\n")

    sets = synthetic_requests(a.requests)
    unpruned = Scrubber(prune_regions=False)
    rows = []
    out["timing"] = {}

    def add(name: str, t: dict) -> None:
        rows.append([name, t["n"], f"{t['p50_us']:.0f}", f"{t['p99_us']:.0f}", f"{t['mean_us']:.0f}"])
        out["timing"][name] = t

    add("fixture record (one text, 1-3 secrets)", timed(lambda r: scrub(r["text"]), records, a.repeat))
    for name, reqs in sets.items():
        add(f"chat request, ~200 words / 3 messages: {name}", timed(scrub_value, reqs, a.repeat))
    pruned = Scrubber()
    for name, scrubber in (("on (default)", pruned), ("off: every region's matcher", unpruned)):
        add(f"chat request, one phone + one email, message texts only, region pruning {name}",
            timed(lambda req, sc=scrubber: [sc.scrub(m["content"]) for m in req["messages"]],
                  sets["one phone + one email"], a.repeat))
    print(f"### Time per request (once per process: `import edgeflow.pii` {import_ms:.0f} ms, first scrub {first_call_ms:.1f} ms; "
          "libphonenumber loads a region's metadata on its first use, the sets below are warmed on 20 items)\n\n"
          + table(["input", "samples", "p50 µs", "p99 µs", "mean µs"], rows) + "\n")
    out["first_call_ms"] = first_call_ms
    out["import_ms"] = import_ms
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, ensure_ascii=False, default=str))


if __name__ == "__main__":
    main()
