"""Phone numbers: libphonenumber's matcher, run only where it can find something (the windows, the words that make
a number a phone or a reference, the per-region rules that rule a window out).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import phonenumbers
from phonenumbers import COUNTRY_CODE_TO_REGION_CODE, PhoneMetadata

try:  # only to skip regions that cannot match (see _RegionRule); if absent, no region is skipped for it
    from phonenumbers.phonenumbermatcher import _formatting_rule_has_first_group_only as _first_group_only
    from phonenumbers.phonenumberutil import _choose_formatting_pattern_for_number as _choose_format
except ImportError:  # pragma: no cover
    _choose_format = _first_group_only = None  # type: ignore[assignment]

try:  # only to compile metadata patterns up front (see _compile_phone_patterns)
    from phonenumbers.re_util import re_compile
except ImportError:  # pragma: no cover
    re_compile = None  # type: ignore[assignment]


# A run of digits joined by the separators phone numbers are written with; "+" or "(" may open it.
_PHONE_WINDOW = re.compile(r"[+(]*[0-9](?:[0-9]|[ ().\-/]{1,3}(?=[(+0-9]))*\)?")


_DIGIT_GROUP = re.compile(r"[0-9]+")


_ANY_DIGIT = re.compile(r"[0-9]")


# A number right after one of these labels is an order/invoice/ticket/… number: neither phone nor ID.
_REFERENCE_BEFORE = re.compile(
    r"(?:order|invoice|ticket|tracking|booking|confirmation|reference|ref|case|serial|isbn|sku|part|model|version"
    r"|seed|port|pid|build|hash|checksum|revision|rev"
    r"|bestell\w*|rechnung\w*|auftrag\w*|sendung\w*|commande|facture|pedido|factura|ordine|fattura|bestelling"
    r"|factuur|zam[oó]wieni\w*|fatura|注文番号|注文|订单号|订单|訂單|주문\s*번호|주문|송장)"
    r"\s*(?:number|no|nr|num|n[º°o]|#|id|番号|号|號|번호)?\.?\s*[:#]?\s*(?:is|ist|est|es|é|は|是)?\s*[:#]?\s*$",
    re.IGNORECASE,
)


# Words that say "phone": near one, bare digits (no "+", separators or leading 0) are a phone number even when
# a unit follows; with Scrubber(bare_phone_needs_word=True), bare digits are a phone number only near one.
_PHONE_WORDS = re.compile(
    r"call|phone|\btel\b|mobile|\bcell|whatsapp|signal|telegram|\bsms\b|\btext|\bring|\bdial|number|contact|reach"
    r"|\bfax|hotline|anruf|\bruf|handy|telefon|nummer|mobil|appel|t[ée]l[ée]phone|portable|num[ée]ro|joindre|llam"
    r"|tel[ée]fono|m[óo]vil|celular|n[úu]mero|chiam|cellulare|\bbel\b|mobiel|zadzwo|kom[óo]rk|numer|soita|puhelin"
    r"|\bliga|contato|電話|携帯|番号|手机|电话|手機|號碼|号码|撥|打给|打給|联系|聯絡|전화|핸드폰|휴대폰|연락|번호"
    r"|फ़?ोन|फोन|मोबाइल|नंबर|कॉल",
    re.IGNORECASE,
)


_BARE_DIGITS = re.compile(r"[1-9][0-9]*")


# A number followed by a unit or counter word, or after a currency sign, is a quantity: not a phone number.
_QUANTITY_AFTER = re.compile(
    r"\s?(?:bytes?\b|[kmgt]i?b\b|rows?\b|lines?\b|records?\b|items?\b|views?\b|users?\b|people\b|persons?\b"
    r"|times\b|steps?\b|tokens?\b|words?\b|copies\b|pages?\b|downloads?\b|visits?\b|votes?\b|likes?\b"
    r"|followers?\b|km\b|kg\b|mg\b|ms\b|cm\b|mm\b|°|%|zeilen|eintr[äa]ge|einwohner|personnes|lignes|habitants"
    r"|personas|filas|l[íi]neas|habitantes|righe|persone|abitanti|rader|invånare|wierszy|os[óo]b|mieszka[ńn]c|linhas"
    r"|pessoas|人|名|件|个|個|元|円|원|명|개|건|倍|行|次|回|字|位|バイト|字节|바이트)",
    re.IGNORECASE,
)


_CURRENCY_BEFORE = re.compile(r"(?:[$€£¥₩₹]|R\$|US\$|EUR|USD|CHF|CNY|JPY|KRW|INR|BRL|RMB)\s?$")


# A leading calendar date (2026-11-29, 29.11.2026, 2026/11/29) is cut off a window before phones are looked for.
_DATE = re.compile(
    r"(?:(?:19|20)[0-9]{2}([-/.])(?:0?[1-9]|1[0-2])\1(?:0?[1-9]|[12][0-9]|3[01])"
    r"|(?:0?[1-9]|[12][0-9]|3[01])([-/.])(?:0?[1-9]|1[0-2])\2(?:19|20)[0-9]{2})(?![0-9])"
)


_PHONE_CTX = 8  # characters either side the matcher sees (it rejects numbers glued to letters, and times)


_NUMBER_TYPES = ("premium_rate", "toll_free", "shared_cost", "voip", "personal_number", "pager", "uan", "voicemail",
                 "fixed_line", "mobile")


@dataclass(frozen=True, eq=False)
class _RegionRule:
    """Which digit strings can be a valid number of a region, read from libphonenumber's own metadata.

    The test `is_valid_number` makes (a number type's lengths and pattern, for any region sharing the
    country code) and the matcher's national-prefix rule, applied to every way the matcher may read the
    digits (as written, after the national prefix, after the country code): a region this rules out cannot
    match, so its matcher is not run. Same findings, less time.
    """

    region: str
    country_code: str
    by_length: dict[int, re.Pattern]  # national number length -> the number-type patterns of that length
    national_prefix: re.Pattern | None
    idd: re.Pattern | None
    metadata: Any = field(repr=False)
    _seen: dict[str, bool] = field(default_factory=dict, repr=False)  # may_match results (numbers recur in chats)

    @classmethod
    def of(cls, region: str) -> "_RegionRule":
        md = PhoneMetadata.metadata_for_region(region)
        if md is None:
            raise ValueError(f"phone region {region!r} has no libphonenumber metadata; use an ISO 3166-1 alpha-2 code")
        patterns: dict[int, list[str]] = {}
        for member in COUNTRY_CODE_TO_REGION_CODE.get(md.country_code, (region,)):  # US: also CA, DO, …
            mmd = PhoneMetadata.metadata_for_region(member)
            if mmd is None or not mmd.general_desc.national_number_pattern:
                continue
            for name in _NUMBER_TYPES:
                desc = getattr(mmd, name)
                if desc is not None and desc.national_number_pattern:
                    for n in desc.possible_length or mmd.general_desc.possible_length:
                        patterns.setdefault(n, []).append(desc.national_number_pattern)
        by_length = {n: re.compile("|".join(f"(?:{p})" for p in dict.fromkeys(ps))) for n, ps in patterns.items() if n > 0}
        prefix = md.national_prefix_for_parsing or md.national_prefix
        return cls(
            region, str(md.country_code), by_length,
            re.compile(prefix) if prefix else None, re.compile(md.international_prefix) if md.international_prefix else None,
            md,
        )

    def may_match(self, digits: str) -> bool:
        """Could `digits` (consecutive digit groups, separators removed) be a valid number of this region?"""
        seen = self._seen.get(digits)
        if seen is None:
            if len(self._seen) > 50_000:
                self._seen.clear()
            seen = self._seen[digits] = self._may_match(digits)
        return seen

    def _may_match(self, digits: str) -> bool:
        if self.idd is not None and (m := self.idd.match(digits)) and m.end() > 0:
            return True  # international format after an exit code: any country may follow
        if self._valid_national(digits) and not self._prefix_required(digits):
            return True
        candidates: set[str] = set()
        if digits.startswith(self.country_code):
            candidates.add(digits[len(self.country_code):])
        if self.national_prefix is not None and (m := self.national_prefix.match(digits)) and m.end() > 0:
            candidates.add(digits[m.end():])
            for i in range(1, len(m.groups()) + 1):  # prefix rules that keep part of the match (BR, JP)
                if m.group(i):
                    candidates.update((m.group(i), digits[m.start(i):], digits[m.end(i):]))
        return any(self._valid_national(c) for c in candidates)

    def _valid_national(self, nsn: str) -> bool:
        pattern = self.by_length.get(len(nsn))
        return pattern is not None and pattern.fullmatch(nsn) is not None

    def _prefix_required(self, nsn: str) -> bool:
        """Would the matcher reject this national number written without the region's national prefix?

        libphonenumber's matcher rule (`_is_national_prefix_present_if_required`: the formatting rule chosen
        for the number); if that internal API is missing, nothing is ruled out by it.
        """
        if self.national_prefix is None or _choose_format is None:
            return False
        try:
            rule = _choose_format(self.metadata.number_format, nsn)
            return bool(
                rule is not None and rule.national_prefix_formatting_rule
                and not rule.national_prefix_optional_when_formatting
                and not _first_group_only(rule.national_prefix_formatting_rule)
            )
        except Exception:  # pragma: no cover - only if phonenumbers' internals change
            return False


def _compile_phone_patterns(regions: Iterable[str]) -> None:
    """Compile the regions' metadata patterns once, into phonenumbers' own pattern cache.

    libphonenumber compiles a metadata pattern the first time a number needs it, through Python's `re`
    cache, which holds 512 patterns: with the fleet's regions that cache overflows and patterns are compiled
    again and again (milliseconds per number). Kept instead, and compiled up front (at import, ~0.1-0.2 s).
    """
    if re_compile is None or not hasattr(phonenumbers, "enable_pattern_cache"):  # pragma: no cover
        return
    phonenumbers.enable_pattern_cache()
    for region in regions:
        md = PhoneMetadata.metadata_for_region(region)
        for member in COUNTRY_CODE_TO_REGION_CODE.get(md.country_code, (region,)) if md else ():
            mmd = PhoneMetadata.metadata_for_region(member)
            if mmd is None:
                continue
            for desc in (mmd.general_desc, *(getattr(mmd, name) for name in _NUMBER_TYPES)):
                if desc is not None and desc.national_number_pattern:
                    re_compile(desc.national_number_pattern)
            for fmt in (*mmd.number_format, *mmd.intl_number_format):
                re_compile(fmt.pattern)
                for lead in fmt.leading_digits_pattern:
                    re_compile(lead)
            for extra in (mmd.international_prefix, mmd.national_prefix_for_parsing, mmd.leading_digits):
                if extra:
                    re_compile(extra)
