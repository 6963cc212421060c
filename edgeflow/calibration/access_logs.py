"""Access-log ingestion: the edge servers' JSONL logs → clean, PII-scrubbed, de-duplicated chat records.

Tiny CPU run: python -m edgeflow.calibration.access_logs data/access_logs --since 2026-11-29T00:00:00Z --hours 24
"""
from __future__ import annotations

import argparse
import json
import string
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from edgeflow import pii as _pii


# PII scrubbing lives in edgeflow.pii (shared with the edge server); `edgeflow.calibration.access_logs.scrub` stays importable.
scrub = _pii.scrub


_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """Lowercase, drop punctuation, collapse whitespace: what makes two requests 'the same question'."""
    return " ".join(text.lower().translate(_PUNCT).split())


@dataclass
class IngestReport:
    """Every count ingestion produced (all logged; none of these conditions is fatal).

    Each line lands in exactly one of: malformed, feedback, completions, outside_window, failed_requests,
    exact_duplicates, near_duplicates, dropped_too_long, kept (`accounted()` adds them up to `lines`).
    """

    files: int = 0
    lines: int = 0
    malformed: int = 0
    feedback: int = 0
    completions: int = 0  # /v1/completions requests: raw prompts, not chat turns (no chat template to calibrate)
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
    malformed_by_field: dict[str, int] = field(default_factory=dict)  # which field made lines malformed

    def accounted(self) -> int:
        """The lines each outcome took; equals `lines` after ingest."""
        return (self.malformed + self.feedback + self.completions + self.outside_window + self.failed_requests + self.exact_duplicates
                + self.near_duplicates + self.dropped_too_long + self.kept)

    def add_malformed(self, where: str, err: "Malformed") -> None:
        self.malformed += 1
        first_of_its_field = err.field not in self.malformed_by_field
        self.malformed_by_field[err.field] = self.malformed_by_field.get(err.field, 0) + 1
        # the first few lines, and the first line of each field, up to MAX_EXAMPLES
        if len(self.malformed_examples) < 5 or first_of_its_field and len(self.malformed_examples) < MAX_EXAMPLES:
            self.malformed_examples.append(f"{where}: {err}")


MAX_EXAMPLES = 12
ROLES = ("system", "user", "assistant")  # what the edge server accepts and logs
KINDS = ("request", "feedback")
COMPLETIONS_ENDPOINT = "/v1/completions"  # logged with `prompt`, not `messages`


class Malformed(ValueError):
    """A log line that is not a request record ingestion can use: names the field, the value and the fix."""

    def __init__(self, field_name: str, value: Any, expected: str) -> None:
        self.field = field_name
        if value is MISSING:
            shown = "nothing (the field is missing)"
        else:
            shown = value if isinstance(value, str) and field_name == "line" else _short(value)
        super().__init__(f"{field_name}: got {shown}; expected {expected}")


MISSING = object()  # a field absent from the record (as opposed to present and null)


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} chars)"


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _parse_ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _record(raw: bytes, first_line: bool) -> dict:
    """One decoded JSON object, or Malformed naming what is wrong with the line."""
    if first_line and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte-order mark written by some editors
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Malformed("line", f"invalid UTF-8 byte 0x{raw[e.start]:02x} at byte {e.start}",
                        "UTF-8 text; re-encode the log as UTF-8") from None
    if not line.strip():
        raise Malformed("line", "an empty line", "one JSON object per line")
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, ints over 4300 digits, absurd nesting
        raise Malformed("line", f"text that is not JSON ({type(e).__name__}: {str(e)[:60]})",
                        "one JSON object per line") from None
    if not isinstance(rec, dict):
        raise Malformed("line", f"a JSON {_JSON_TYPES.get(type(rec), 'value')}: {_short(rec)}", "a JSON object")
    return rec


def _check_envelope(rec: dict) -> datetime:
    """The fields every request line needs before its window and status are read; returns its timestamp."""
    if "ts" not in rec:
        raise Malformed("ts", MISSING, 'an ISO-8601 time with a UTC offset, e.g. "2026-11-29T09:41:49.966Z"')
    ts = rec["ts"]
    try:
        parsed = _parse_ts(ts) if isinstance(ts, str) else None
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise Malformed("ts", ts, 'an ISO-8601 time with a UTC offset, e.g. "2026-11-29T09:41:49.966Z"')
    status = rec.get("status", 200)
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
        raise Malformed("status", status, "an HTTP status code, an integer 100-599")
    if not isinstance(rec.get("response"), (str, type(None))):
        raise Malformed("response", rec["response"], "the generated text (a string), or null for a failed request")
    if not isinstance(rec.get("id"), (str, type(None))):
        raise Malformed("id", rec["id"], "a string request id, or null")
    return parsed


def _check_messages(rec: dict) -> list[dict]:
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise Malformed("messages", msgs if "messages" in rec else MISSING,
                        'a non-empty list of {"role", "content"} objects')
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise Malformed(f"messages[{i}]", m, 'an object {"role": ..., "content": ...}')
        if m.get("role") not in ROLES:
            raise Malformed(f"messages[{i}].role", m.get("role", MISSING), f"one of {list(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise Malformed(f"messages[{i}].content", m.get("content", MISSING), "a string")
    if not any(m["role"] == "user" for m in msgs):
        raise Malformed("messages", [m["role"] for m in msgs], "at least one user message")
    return msgs


def _lines(path: Path) -> list[bytes]:
    """The file's lines as bytes (split on \\n only: JSON strings may hold U+2028 and other separators)."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]


def ingest(
    paths: list[Path],
    since: datetime | None = None,
    until: datetime | None = None,
    max_words: int = 400,
    drop_over_words: int = 4000,
) -> tuple[list[dict], IngestReport]:
    """Read request lines from JSONL access logs in [since, until): scrub, de-duplicate, bound length.

    A line of any shape is counted, never fatal: not UTF-8, not JSON, not an object, or a request whose
    fields have the wrong type or value is `malformed` (an example naming the field is kept). Checked in
    order: `kind` (absent, "request" or "feedback"), `ts`/`status`/`response`/`id`, then `messages` unless
    the request failed (non-200 status or empty response: logged with whatever the client sent), then the
    time window and the status.
    Entries longer than `drop_over_words` are dropped (pasted logs and tables teach a quantizer nothing
    about chat traffic); entries over `max_words` are truncated. Both are counted. Kept text is scrubbed
    with edgeflow.pii (logs from older servers are raw).
    """
    rep = IngestReport()
    seen_exact: set[str] = set()
    seen_norm: set[str] = set()
    out: list[dict] = []
    for path in sorted(paths):
        rep.files += 1
        for n, raw in enumerate(_lines(path), 1):
            rep.lines += 1
            try:
                rec = _record(raw, n == 1)
                kind = rec.get("kind", "request")
                if kind not in KINDS:
                    raise Malformed("kind", kind, f"one of {list(KINDS)} (or absent: a request)")
                if kind == "feedback":
                    rep.feedback += 1
                    continue
                if rec.get("endpoint") == COMPLETIONS_ENDPOINT:
                    rep.completions += 1
                    continue
                ts = _check_envelope(rec)
                failed = rec.get("status", 200) != 200 or not rec.get("response")
                msgs = [] if failed else _check_messages(rec)  # a rejected request is logged with what it sent
            except Malformed as e:
                rep.add_malformed(f"{path}:{n}", e)
                continue
            if (since and ts < since) or (until and ts >= until):
                rep.outside_window += 1
                continue
            if failed:
                rep.failed_requests += 1
                continue
            kept = _clean(rec, msgs, rep, seen_exact, seen_norm, max_words, drop_over_words)
            if kept is not None:
                out.append(kept)
    rep.kept = len(out)
    return out, rep


def _clean(rec: dict, msgs: list[dict], rep: IngestReport, seen_exact: set[str], seen_norm: set[str],
           max_words: int, drop_over_words: int) -> dict | None:
    """De-duplicate, bound and scrub one valid request (counting what happened), or None if it is not kept."""
    exact_key = json.dumps([msgs, rec["response"]], sort_keys=True)
    if exact_key in seen_exact:
        rep.exact_duplicates += 1
        return None
    seen_exact.add(exact_key)
    norm_key = normalize(" ".join(m["content"] for m in msgs if m["role"] == "user"))
    if norm_key in seen_norm:
        rep.near_duplicates += 1
        return None
    seen_norm.add(norm_key)
    words = sum(len(m["content"].split()) for m in msgs) + len(rec["response"].split())
    if words > drop_over_words:
        rep.dropped_too_long += 1
        return None
    pii: dict[str, int] = {}
    clean_msgs = []
    for m in msgs:
        text, found = _pii.scrub(m["content"])
        _pii.merge_counts(pii, found)
        clean_msgs.append({"role": m["role"], "content": text})
    response, found = _pii.scrub(rec["response"])
    _pii.merge_counts(pii, found)
    if pii:
        rep.records_with_pii += 1
        _pii.merge_counts(rep.pii_replaced, pii)
    if words > max_words:
        rep.truncated += 1
        response = " ".join(response.split()[: max(32, max_words // 4)])
        clean_msgs = [{"role": m["role"], "content": " ".join(m["content"].split()[:max_words])} for m in clean_msgs]
    return {"messages": clean_msgs, "response": response, "ts": rec["ts"], "id": rec.get("id")}


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
