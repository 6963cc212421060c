"""The scrubbing policy (Scrubber): detectors first, each claiming its characters, then phone numbers, then the
numbers a label names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from phonenumbers import Leniency, PhoneNumberMatcher

from edgeflow.pii.detectors import (CONTEXT_AFTER, CONTEXT_BEFORE, COVERED_REGIONS, DETECTORS, Detector, Finding,
    PHONE_KIND, PHONE_LENIENCY, PHONE_MIN_DIGITS, _FOLD, _MASK, _NOT_DIGIT, _SEPARATED)
from edgeflow.pii.labels import (LABELLED_MIN_DIGITS, _Candidate, _accepted_end, _around, _candidates,
    _digit_count, _group_spans, _in_arithmetic, _is_quantity, _is_reference, _labelled_numbers, _masked, _trimmed,
    _uncovered_digits)
from edgeflow.pii.phones import (_ANY_DIGIT, _BARE_DIGITS, _DATE, _DIGIT_GROUP, _PHONE_CTX, _PHONE_WINDOW,
    _PHONE_WORDS, _RegionRule, _compile_phone_patterns)


@dataclass
class Scrubber:
    """The scrubbing policy; the module-level `scrub`/`find` use the default one (other settings: benchmarks)."""

    detectors: tuple[Detector, ...] = DETECTORS
    phone_regions: tuple[str, ...] = COVERED_REGIONS
    leniency: Leniency = PHONE_LENIENCY
    # Digits-only numbers without a leading 0 and no phone word near: replaced unless a unit or currency sign
    # makes them a quantity; True: never replaced (fewer false positives, lower recall; see benchmarks/pii.py).
    bare_phone_needs_word: bool = False
    prune_regions: bool = True  # skip regions whose metadata rules a window out (same findings, less time)
    _rules: tuple[_RegionRule, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rules = tuple(_RegionRule.of(r) for r in self.phone_regions)
        _compile_phone_patterns(self.phone_regions)

    def find(self, text: str) -> list[Finding]:
        """Every PII span in text, by position (non-overlapping; earlier detectors win)."""
        if not isinstance(text, str):
            raise TypeError(f"scrub(text): text must be str, got {type(text).__name__}; use scrub_value for JSON values")
        view = text if text.isascii() else text.translate(_FOLD)  # same length: offsets stay valid
        first = _ANY_DIGIT.search(view)
        runs = [] if first is None else [(w.start(), w.end(), _digit_count(w.group(0)))
                                         for w in _PHONE_WINDOW.finditer(view, first.start())]
        longest = max((n for _, _, n in runs), default=0)
        # "+44 7400 123456": a run opened by "+" with at most 15 digits (E.164) is one international phone number
        id_runs = [(s, e, n) for s, e, n in runs if not (view[s] == "+" and n <= 15)]
        id_longest = max((n for _, _, n in id_runs), default=0)
        found: list[Finding] = []
        # Pass 1: every detector, candidates with a word naming their kind near (so "Steuer-ID 12345678901" is
        # read as a Steuer-ID even if another 11-digit check happens to pass); pass 2: the unlabelled rest.
        later: list[tuple[Detector, list[_Candidate]]] = []
        for det in self.detectors:
            if det.hints:
                if not any(h in view for h in det.hints):
                    continue
                spans = [(0, len(view))]
            elif id_longest == 0 or id_longest < det.min_digits:
                continue
            else:  # numbers: searched only around digit runs long enough for them (no digits: free)
                spans = _around([(s, e) for s, e, n in id_runs if n >= det.min_digits], len(view))
            cands = _candidates(det, view, text, spans)
            later.append((det, [c for c in cands if not c.labelled and det.label is not None]))
            view = self._judge(det, view, [c for c in cands if c.labelled or det.label is None], found)
        for det, cands in later:
            view = self._judge(det, view, [c for c in cands if _MASK not in view[c.start:c.end]], found)
        if self.phone_regions and longest >= PHONE_MIN_DIGITS:
            found.extend(self._phones(view, text))
        if longest >= LABELLED_MIN_DIGITS:  # what the user names as a phone number or an ID, whatever checks say
            found.extend(_labelled_numbers(_masked(view, found), text))
        return sorted(found, key=lambda f: f.start)

    def scrub(self, text: str) -> tuple[str, dict[str, int]]:
        """Text with every finding replaced by its placeholder, and the number of findings by kind."""
        findings = self.find(text)
        if not findings:
            return text, {}
        parts: list[str] = []
        counts: dict[str, int] = {}
        pos = 0
        for f in findings:
            parts += [text[pos:f.start], f.placeholder]
            counts[f.kind] = counts.get(f.kind, 0) + 1
            pos = f.end
        parts.append(text[pos:])
        return "".join(parts), counts

    @staticmethod
    def _judge(det: Detector, view: str, cands: list[_Candidate], found: list[Finding]) -> str:
        """Add accepted candidates to `found`; returns the view with accepted and kept ones masked."""
        claimed: list[Finding] = []
        for c in cands:
            end = _accepted_end(det, view, c.start, c.end)
            if end is None and (c.labelled or det.keep_rejected == "replace"):  # fail closed: named as this kind, it
                end = c.start + len(view[c.start:c.end].rstrip(_NOT_DIGIT)) if det.shrink else c.end  # is replaced
                # even when its check fails (a mistyped ID is still somebody's); a shrinking shape up to its last
                # digit (not "IBAN DE00 … EUR"'s currency)
            elif end is None:  # rejected, unnamed: keeps its digits
                continue
            separated = _SEPARATED.search(view, c.start, end) is not None
            if not c.labelled and (det.needs_label == "always" or det.needs_label == "bare" and not separated):
                continue
            accepted = Finding(c.start, end, det.kind, det.placeholder, det.region)
            found.append(accepted)
            claimed.append(accepted)
        return _masked(view, claimed) if claimed else view

    def _phones(self, view: str, text: str) -> list[Finding]:
        found: list[Finding] = []
        for w in _PHONE_WINDOW.finditer(view):
            ws, window = w.start(), w.group(0)
            if (date := _DATE.match(window)) is not None:  # "2026-11-29 14:05": the date part is no number
                ws, window = ws + date.end(), window[date.end():]
            groups = [(g.start(), g.end()) for g in _DIGIT_GROUP.finditer(window)]
            if sum(e - s for s, e in groups) < PHONE_MIN_DIGITS or _is_reference(text, ws) or _in_arithmetic(
                    view, ws, ws + len(window)):
                continue
            for sub_start, sub in _trimmed(window, groups):
                sub_groups = [(g.start(), g.end()) for g in _DIGIT_GROUP.finditer(sub)]
                s, e = ws + sub_start, ws + sub_start + len(sub)
                lo = max(0, s - _PHONE_CTX) if sub_start == 0 else s  # a trimmed side shows no context: the
                hi = min(len(view), e + _PHONE_CTX) if sub_start + len(sub) == len(window) else e  # cut digits
                hits = self._phones_in_window(view, text, s, e, sub, sub_groups, lo, hi)
                if hits:
                    found.extend(hits)
                    break
        return found

    def _phones_in_window(self, view: str, text: str, ws: int, we: int, window: str,
                          groups: list[tuple[int, int]], lo: int, hi: int) -> list[Finding]:
        """Phone numbers inside view[ws:we], the matcher reading view[lo:hi] (the window with some context)."""
        found: list[Finding] = []
        for rule in self._regions_for(window, groups):
            sub = (_masked(view, found) if found else view)[lo:hi]
            try:
                spans = [(lo + m.start, lo + m.end) for m in PhoneNumberMatcher(sub, rule.region, leniency=self.leniency)]
            except Exception:  # noqa: BLE001 - fail closed, as the ID validators do (detectors._stdnum): a matcher that
                return [Finding(ws, we, PHONE_KIND, "[PHONE]", rule.region)]  # raises masks the whole digit window
            for s, e in spans:
                if s < ws or e > we or any(s < f.end and f.start < e for f in found) or _digit_count(
                        view[s:e]) < PHONE_MIN_DIGITS:
                    continue
                if _BARE_DIGITS.fullmatch(view, s, e) and not _PHONE_WORDS.search(
                        text, max(0, s - CONTEXT_BEFORE), e + CONTEXT_AFTER) and (
                        self.bare_phone_needs_word or _is_quantity(text, s, e)):
                    continue
                found.append(Finding(s, e, PHONE_KIND, "[PHONE]", rule.region))
            if found and _uncovered_digits(ws, groups, found) < PHONE_MIN_DIGITS:
                break
        return found

    def _regions_for(self, window: str, groups: list[tuple[int, int]]) -> Iterator[_RegionRule]:
        """The regions whose matcher could find a number in the window, most likely first, lazily."""
        if not self.prune_regions:
            yield from self._rules
            return
        tried: set[str] = set()
        if "+" in window:  # international format: any region's matcher reads it the same way
            tried.add(self._rules[0].region)
            yield self._rules[0]
        whole = "".join(window[s:e] for s, e in groups)
        for rule in self._rules:  # the whole window is one number of the region
            if rule.region not in tried and rule.may_match(whole):
                tried.add(rule.region)
                yield rule
        spans = _group_spans(window, groups) - {whole}
        for rule in self._rules:  # part of it is
            if rule.region not in tried and any(rule.may_match(d) for d in spans):
                tried.add(rule.region)
                yield rule
