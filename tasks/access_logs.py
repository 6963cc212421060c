"""Access-log ingestion: the edge servers' JSONL logs → clean, PII-scrubbed, de-duplicated chat records.

Tiny CPU run: python -m tasks.access_logs data/access_logs --since 2026-11-29T00:00:00Z --hours 24
"""
from __future__ import annotations

import argparse
import json
import re
import string
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path


def _luhn_ok(digits: str) -> bool:
    total, alt = 0, False
    for ch in reversed(digits):
        d = int(ch)
        if alt:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
        alt = not alt
    return total % 10 == 0


def _card(m: re.Match) -> str:
    digits = re.sub(r"\D", "", m.group(0))
    return "[CARD]" if 13 <= len(digits) <= 19 and _luhn_ok(digits) else m.group(0)


# Order matters: secrets and cards before phone numbers, which would otherwise eat their digits.
PII_PATTERNS: list[tuple[str, re.Pattern, object]] = [
    ("jwt", re.compile(r"\b(?:Bearer\s+)?eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"), "[TOKEN]"),
    ("api_key", re.compile(r"\b(?:sk|pk|rk)-(?:proj-|live-|test-)?[A-Za-z0-9_-]{16,}"), "[API_KEY]"),
    ("github_token", re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), "[API_KEY]"),
    ("aws_key", re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "[API_KEY]"),
    ("bearer", re.compile(r"\bBearer\s+[A-Za-z0-9._~+/-]{20,}=*"), "[TOKEN]"),
    ("email", re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b"), "[EMAIL]"),
    ("card", re.compile(r"\b(?:\d[ -]?){12,18}\d\b"), _card),
    ("ssn", re.compile(r"\b\d{3}-\d{2}-\d{4}\b"), "[NATIONAL_ID]"),
    ("uk_nino", re.compile(r"\b[A-CEGHJ-PR-TW-Z]{2}\s?\d{2}\s?\d{2}\s?\d{2}\s?[A-D]\b"), "[NATIONAL_ID]"),
    # Not inside a longer run of digit groups (order numbers, card-like numbers that fail Luhn).
    ("phone", re.compile(r"(?<!\d\s)(?<![\w-])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)\s?|\d{2,4}[\s.-])\d{3,4}[\s.-]\d{3,4}(?![\w-]|\s\d)"), "[PHONE]"),
]


def scrub(text: str) -> tuple[str, dict[str, int]]:
    """Replace PII and secrets with typed placeholders; returns the text and what was replaced, by kind."""
    found: dict[str, int] = {}
    for kind, pattern, repl in PII_PATTERNS:
        def sub(m, kind=kind, repl=repl):
            out = repl(m) if callable(repl) else repl
            if out != m.group(0):
                found[kind] = found.get(kind, 0) + 1
            return out

        text = pattern.sub(sub, text)
    return text, found


_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """Lowercase, drop punctuation, collapse whitespace: what makes two requests 'the same question'."""
    return " ".join(text.lower().translate(_PUNCT).split())


@dataclass
class IngestReport:
    """Every count ingestion produced (all logged; none of these conditions is fatal)."""

    files: int = 0
    lines: int = 0
    malformed: int = 0
    feedback: int = 0
    outside_window: int = 0
    failed_requests: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0
    dropped_too_long: int = 0
    truncated: int = 0
    pii_replaced: dict[str, int] = field(default_factory=dict)
    records_with_pii: int = 0
    kept: int = 0
    malformed_examples: list[str] = field(default_factory=list)


def _parse_ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def ingest(
    paths: list[Path],
    since: datetime | None = None,
    until: datetime | None = None,
    max_words: int = 400,
    drop_over_words: int = 4000,
) -> tuple[list[dict], IngestReport]:
    """Read request lines from JSONL access logs in [since, until): scrub, de-duplicate, bound length.

    Entries longer than `drop_over_words` are dropped (pasted logs and tables teach a quantizer nothing
    about chat traffic); entries over `max_words` are truncated. Both are counted.
    """
    rep = IngestReport()
    seen_exact: set[str] = set()
    seen_norm: set[str] = set()
    out: list[dict] = []
    for path in sorted(paths):
        rep.files += 1
        for n, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
            rep.lines += 1
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not an object")
                if rec.get("kind", "request") == "feedback":
                    rep.feedback += 1
                    continue
                msgs = rec["messages"]
                if not isinstance(msgs, list) or not all(isinstance(m, dict) and "content" in m and "role" in m for m in msgs):
                    raise ValueError("messages is not a list of {role, content}")
                ts = _parse_ts(rec["ts"])
            except (ValueError, KeyError, TypeError) as e:
                rep.malformed += 1
                if len(rep.malformed_examples) < 5:
                    rep.malformed_examples.append(f"{path}:{n}: {type(e).__name__}: {str(e)[:80]}")
                continue
            if (since and ts < since) or (until and ts >= until):
                rep.outside_window += 1
                continue
            if rec.get("status", 200) != 200 or not rec.get("response"):
                rep.failed_requests += 1
                continue
            exact_key = json.dumps([msgs, rec["response"]], sort_keys=True)
            if exact_key in seen_exact:
                rep.exact_duplicates += 1
                continue
            seen_exact.add(exact_key)
            norm_key = normalize(" ".join(m["content"] for m in msgs if m["role"] == "user"))
            if norm_key in seen_norm:
                rep.near_duplicates += 1
                continue
            seen_norm.add(norm_key)
            words = sum(len(m["content"].split()) for m in msgs) + len(rec["response"].split())
            if words > drop_over_words:
                rep.dropped_too_long += 1
                continue
            pii: dict[str, int] = {}
            clean_msgs = []
            for m in msgs:
                text, found = scrub(m["content"])
                for k, v in found.items():
                    pii[k] = pii.get(k, 0) + v
                clean_msgs.append({"role": m["role"], "content": text})
            response, found = scrub(rec["response"])
            for k, v in found.items():
                pii[k] = pii.get(k, 0) + v
            if pii:
                rep.records_with_pii += 1
                for k, v in pii.items():
                    rep.pii_replaced[k] = rep.pii_replaced.get(k, 0) + v
            if words > max_words:
                rep.truncated += 1
                response = " ".join(response.split()[: max(32, max_words // 4)])
                clean_msgs = [{"role": m["role"], "content": " ".join(m["content"].split()[:max_words])} for m in clean_msgs]
            out.append({"messages": clean_msgs, "response": response, "ts": rec["ts"], "id": rec.get("id")})
    rep.kept = len(out)
    return out, rep


def log_files(root: Path) -> list[Path]:
    """Every *.jsonl (and rotated *.jsonl.N) access log under root."""
    return sorted(p for p in Path(root).rglob("*") if p.is_file() and (p.suffix == ".jsonl" or ".jsonl." in p.name))


def write_jsonl(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("root")
    ap.add_argument("--since", help="ISO-8601 start of the window (default: now - hours)")
    ap.add_argument("--hours", type=float, default=24)
    a = ap.parse_args()
    since = _parse_ts(a.since) if a.since else datetime.now(timezone.utc) - timedelta(hours=a.hours)
    records, report = ingest(log_files(Path(a.root)), since, since + timedelta(hours=a.hours))
    print(json.dumps(asdict(report), indent=1))
