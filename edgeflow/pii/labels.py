"""The helpers the Scrubber decides with: labelled numbers (fail closed on what the user names), candidates around
digit runs, quantities, references, arithmetic, dates.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from edgeflow.pii.detectors import CONTEXT_AFTER, CONTEXT_BEFORE, Detector, Finding, PHONE_MIN_DIGITS, _MASK
from edgeflow.pii.phones import _CURRENCY_BEFORE, _QUANTITY_AFTER, _REFERENCE_BEFORE


# A number right after a word naming it as a phone number or an ID (with "number", "is", ":" and the like between)
# is replaced whatever libphonenumber or a checksum says of it: "我的手机号是<an unassigned range>", "my ID number
# is <a mistyped one>". In the fleet's languages (COVERED_REGIONS).
_PHONE_LABELS = (
    r"phone|mobile|cell(?:phone)?|\btel\b|telephone|whatsapp|handy|telefon|mobil|rufnummer|t[ée]l[ée]phone|portable"
    r"|tel[ée]fono|m[óo]vil|celular|cellulare|mobiel|telefoon|kom[óo]rk\w*|puhelin|matkapuhelin"
    r"|手机|手機|电话|電話|携帯|ケータイ|전화|핸드폰|휴대폰|फ़ोन|फोन|मोबाइल"
)


_ID_LABELS = (
    r"\bid(?=\s*(?:number|no\b|nr\b|card|#|:))|\bmy id\b|identity|identit[ée]|identidad|identit[àa]|ausweis\w*"
    r"|passport|reisepass|passeport|pasaporte|passaporto|paspoort|paszport|passnummer"
    r"|身份证|身份證|身分證|证件|證件|护照|護照|マイナンバー|個人番号|パスポート|주민등록|주민|여권"
    r"|aadhaa?r|\bcpf\b|\bdni\b|\bnie\b|\bssn\b|social security|\bbsn\b|pesel|personnummer|henkilötunnus|\bnhs\b"
    r"|national insurance|steuer-?id|codice fiscale|\bnir\b|\bahv\b|registre national|rijksregister"
)


_LABELLED_NUMBER = re.compile(
    rf"(?:(?P<phone>{_PHONE_LABELS})|(?P<id>{_ID_LABELS}))"
    r"[^\S\n]{0,3}(?:numbers?|no\.?|nr\.?|n[º°o]\.?|num[ée]ro|n[úu]mero|nummer|numer|numero|number|號碼|号码|号|號|番号"
    r"|字號|번호)?"
    r"[^\S\n]{0,3}(?:is|was|ist|war|est|était|es|era|é|è|jest|är|on|は|是|为|為|는|은|이|가)?"
    r"[^\S\n]{0,3}(?:le|la|el|il|o|a|der|die)?[^\S\n]{0,3}[:：#=]?[^\S\n]{0,3}"  # "est le 06 …", "é o 11 …"
    r"(?P<num>(?P<letters>[A-Z]{1,2}(?=[0-9]))?\+?\(?[0-9](?:[0-9]|[ ().\-/](?=[0-9(]))*[0-9](?:[Xx](?![A-Za-z0-9]))?)",
    re.IGNORECASE,
)


LABELLED_MIN_DIGITS = 6  # an ID this short (a Spanish NIE's digits, a passport's) still has a label in front


_LABELLED_DIGITS = {"phone": (7, 15), "id": (6, 20)}  # what a phone number (E.164) or an ID can plausibly be


def _labelled_numbers(view: str, text: str) -> list[Finding]:
    """Numbers of plausible length right after a phone or ID label, in `view` (already-found spans masked)."""
    found = []
    for m in _LABELLED_NUMBER.finditer(view):
        kind = "phone" if m.group("phone") else "id"
        lo, hi = _LABELLED_DIGITS[kind]
        if not lo <= _digit_count(m.group("num")) <= hi or _is_reference(text, m.start()) or (
                kind == "phone" and m.group("letters")):  # a letter-led number is a passport's or an ID card's
            continue
        if kind == "phone":
            found.append(Finding(m.start("num"), m.end("num"), "labelled_phone", "[PHONE]", None))
        else:
            found.append(Finding(m.start("num"), m.end("num"), "labelled_id", "[NATIONAL_ID]", None))
    return found


def _around(runs: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Merged [start - _MARGIN, end + _MARGIN) ranges around runs: every candidate containing a run lies inside."""
    spans: list[tuple[int, int]] = []
    for s, e in runs:
        s, e = max(0, s - _MARGIN), min(size, e + _MARGIN)
        if spans and s <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(e, spans[-1][1]))
        else:
            spans.append((s, e))
    return spans


_MARGIN = 48  # longer than any national ID, card or IBAN as written (42 characters with spaces)


@dataclass(frozen=True)
class _Candidate:
    start: int
    end: int
    labelled: bool  # a word naming the detector's kind is near


def _candidates(det: Detector, view: str, text: str, spans: list[tuple[int, int]]) -> list[_Candidate]:
    out = []
    for m in (m for a, b in spans for m in det.pattern.finditer(view, a, b)):
        if det.region is not None and _is_reference(text, m.start()):
            continue
        labelled = det.label is not None and det.label.search(
            text, max(0, m.start() - CONTEXT_BEFORE), m.end() + CONTEXT_AFTER) is not None
        out.append(_Candidate(m.start(), m.end(), labelled))
    return out


def _accepted_end(det: Detector, view: str, start: int, end: int) -> int | None:
    """Where the accepted candidate ends (shrinking ones retry shorter prefixes), None if rejected."""
    stops = range(end, start, -1) if det.shrink else (end,)
    for stop in stops:
        if stop < end and not view[stop - 1].isalnum():
            continue
        cand = view[start:stop]
        compact = cand.translate(_strip_table(det.strip)).upper()
        if det.validate is None or det.validate(compact):
            return stop
    return None


@functools.lru_cache(maxsize=None)
def _strip_table(chars: str) -> dict[int, None]:
    return str.maketrans("", "", chars)


def _is_quantity(text: str, start: int, end: int) -> bool:
    """'48213907 rows', '21893095人', '$1299000': a count or an amount."""
    return _QUANTITY_AFTER.match(text, end) is not None or _CURRENCY_BEFORE.search(text, max(0, start - 5), start) is not None


def _is_reference(text: str, start: int) -> bool:
    return _REFERENCE_BEFORE.search(text, max(0, start - 40), start) is not None


_OPERATOR_BEFORE = re.compile(r"[=×÷*^<>] *$")


_OPERATOR_AFTER = re.compile(r" *[=×÷*^<>%]")


def _in_arithmetic(view: str, start: int, end: int) -> bool:
    """'40 × 75 = 3000 / 100 = 30': a window next to an operator is a calculation, not a phone number."""
    return _OPERATOR_BEFORE.search(view, max(0, start - 3), start) is not None or _OPERATOR_AFTER.match(view, end) is not None


def _digit_count(s: str) -> int:
    return sum(1 for ch in s if "0" <= ch <= "9")


def _masked(view: str, findings: Iterable[Finding]) -> str:
    chars = list(view)
    for f in findings:
        chars[f.start:f.end] = _MASK * (f.end - f.start)
    return "".join(chars)


_SHORT_GROUP = 3  # digits of a group that may be a separate number next to a phone ("… 23456789 30 minutes")


def _trimmed(window: str, groups: list[tuple[int, int]]) -> Iterator[tuple[int, str]]:
    """The window, then without a short first or last group set off by a space: libphonenumber reads
    "0151 23456789 30" as one candidate and finds no number in it, but finds "0151 23456789"."""
    yield 0, window
    first = len(groups) > 2 and groups[0][1] - groups[0][0] <= _SHORT_GROUP and window[groups[0][1]] == " "
    last = len(groups) > 2 and groups[-1][1] - groups[-1][0] <= _SHORT_GROUP and window[groups[-1][0] - 1] == " "
    starts = [groups[1][0]] if first else []
    ends = [groups[-2][1]] if last else []
    for s, e in [(0, end) for end in ends] + [(start, len(window)) for start in starts] + [
            (start, end) for start in starts for end in ends if start < end]:
        if _digit_count(window[s:e]) >= PHONE_MIN_DIGITS:
            yield s, window[s:e]


def _group_spans(window: str, groups: list[tuple[int, int]]) -> set[str]:
    """The digits of every run of consecutive digit groups a number could occupy (7-17 digits)."""
    out: set[str] = set()
    for i in range(len(groups)):
        digits = ""
        for j in range(i, len(groups)):
            digits += window[groups[j][0]:groups[j][1]]
            if len(digits) > 17:
                break
            if len(digits) >= PHONE_MIN_DIGITS:
                out.add(digits)
    return out


def _uncovered_digits(ws: int, groups: list[tuple[int, int]], found: list[Finding]) -> int:
    return sum(1 for s, e in groups for i in range(ws + s, ws + e) if not any(f.start <= i < f.end for f in found))
