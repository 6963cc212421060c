"""What is looked for: the regions and placeholders, the folded view of the text, and one Detector per kind of
secret, card, IBAN and national ID (a regex for the shape, a validator for the check digits, a label word).
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Literal

from phonenumbers import Leniency
from stdnum import iban as _iban
from stdnum import luhn as _luhn
from stdnum.be import nn as _be_nn
from stdnum.br import cpf as _br_cpf
from stdnum.ch import ssn as _ch_ssn
from stdnum.cn import ric as _cn_ric
from stdnum.de import idnr as _de_idnr
from stdnum.es import dni as _es_dni
from stdnum.es import nie as _es_nie
from stdnum.fi import hetu as _fi_hetu
from stdnum.fr import nir as _fr_nir
from stdnum.gb import nhs as _gb_nhs
from stdnum.in_ import aadhaar as _in_aadhaar
from stdnum.in_ import pan as _in_pan
from stdnum.it import codicefiscale as _it_cf
from stdnum.jp import in_ as _jp_in
from stdnum.kr import rrn as _kr_rrn
from stdnum.nl import bsn as _nl_bsn
from stdnum.pl import pesel as _pl_pesel
from stdnum.se import personnummer as _se_pnr
from stdnum.us import ssn as _us_ssn


# The regions the fleet serves: national-format phone numbers and the national IDs of the package doc are covered for
# these (international "+…" numbers are found for every country). Order = order the phone matcher tries them.
COVERED_REGIONS: tuple[str, ...] = (
    "US", "GB", "DE", "FR", "ES", "IT", "NL", "SE", "PL", "BE", "CH", "FI", "CN", "JP", "KR", "TW", "IN", "BR",
)


PLACEHOLDERS: tuple[str, ...] = ("[PHONE]", "[NATIONAL_ID]", "[IBAN]", "[CARD]", "[EMAIL]", "[API_KEY]", "[TOKEN]")


# Phone numbers are looked for only in windows with at least this many digits (libphonenumber also accepts
# shorter local numbers, which are indistinguishable from prices and counts).
PHONE_MIN_DIGITS = 7


# VALID: a dialable number of the region (a number type's length and prefix). POSSIBLE accepts any digit
# string of a possible length; the grouping leniencies also reject national numbers grouped unusually.
# Compared on the fixture by benchmarks/pii.py.
PHONE_LENIENCY = Leniency.VALID


CONTEXT_BEFORE, CONTEXT_AFTER = 48, 24  # characters around a candidate searched for a label word


PHONE_KIND = "phone"


def _fold_table() -> dict[int, str]:
    table: dict[int, str] = {}
    for cp in range(0x80, 0x10000):
        if unicodedata.category(chr(cp)) == "Nd":
            table[cp] = str(unicodedata.digit(chr(cp)))
    for cp in range(0xFF01, 0xFF5F):  # full-width ASCII, as Japanese and Chinese input methods type it
        table[cp] = chr(cp - 0xFEE0)
    for cp in (0x00A0, 0x1680, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000):
        table[cp] = " "
    for cp in (*range(0x2010, 0x2016), 0x2212, 0xFE63):
        table[cp] = "-"
    return table


_FOLD = _fold_table()


_MASK = "#"  # what claimed characters become in the view: neither digit, letter nor separator


@dataclass(frozen=True)
class Detector:
    """One kind of PII: candidate spans by regex on the folded view, replaced if `validate` accepts them."""

    kind: str  # key in the counts scrub() returns
    placeholder: str
    region: str | None  # ISO 3166-1 alpha-2; None for kinds that are not national
    pattern: re.Pattern
    validate: Callable[[str], bool] | None = None  # gets the candidate without the characters in `strip`
    strip: str = " ./-"
    # Words naming the ID. needs_label: "always" = replaced only with a label near; "bare" = only when
    # written without separators. A candidate the validator rejects with a label near keeps its digits.
    label: re.Pattern | None = None
    needs_label: Literal["never", "bare", "always"] = "never"
    hints: tuple[str, ...] = ()  # cheap pre-check: the text must contain one of these (none: a digit run)
    min_digits: int = 0  # only searched around runs of this many digits (separators allowed)
    shrink: bool = False  # a rejected candidate is retried without trailing characters (IBAN + next word)
    # A rejected candidate (its check fails) is replaced when labelled (fail closed); unlabelled, "labelled" lets it
    # keep its digits, and "replace" replaces it too: for a shape that names its kind as a label would (an IBAN).
    keep_rejected: Literal["labelled", "replace"] = "labelled"


_L = r"(?<![A-Za-z0-9+])(?<![0-9][ .-])"  # not inside a word, a run of digit groups, or after "+" (a phone)


_R = r"(?![A-Za-z0-9])(?![ .-][0-9])"


_SEPARATED = re.compile(r"[ .\-/]")


_NOT_DIGIT = "".join(chr(c) for c in range(128) if not chr(c).isdigit())


def _rx(body: str, flags: int = 0) -> re.Pattern:
    return re.compile(_L + body + _R, flags)


def _kw(words: str) -> re.Pattern:
    return re.compile(words, re.IGNORECASE)


def _stdnum(module: Any) -> Callable[[str], bool]:
    def ok(number: str) -> bool:
        try:
            return bool(module.is_valid(number))
        except Exception:  # fail closed: a validator that raises (python-stdnum's CN table lookup raises KeyError
            return True  # for a checksum-valid number whose region code it lacks) counts as a hit

    return ok


_CARD_IIN = re.compile(r"2[2-7]|3[0-9]|4|5[0-8]|6")  # Visa, Mastercard, Amex, Diners, JCB, Discover, UnionPay, Maestro


def _card_ok(digits: str) -> bool:
    return 13 <= len(digits) <= 19 and _CARD_IIN.match(digits) is not None and _luhn.is_valid(digits)


_TW_LETTERS = "ABCDEFGHJKLMNPQRSTUVXYWZIO"  # the ID rules number these 10, 11, … 35


def _tw_id_ok(number: str) -> bool:
    """Taiwan ID card / resident certificate number (A123456789): letter code + 9 digits, weighted sum mod 10."""
    if len(number) != 10 or not number[1:].isdigit() or number[0] not in _TW_LETTERS or number[1] not in "1289":
        return False
    code = _TW_LETTERS.index(number[0]) + 10
    digits = [code // 10, code % 10, *map(int, number[1:])]
    return sum(d * w for d, w in zip(digits, (1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 1))) % 10 == 0


def _nino_ok(number: str) -> bool:
    return number[:2] not in {"BG", "GB", "KN", "NK", "NT", "TN", "ZZ"}


_SECRETS: tuple[Detector, ...] = (
    Detector("jwt", "[TOKEN]", None, re.compile(
        r"(?<![A-Za-z0-9_-])(?:Bearer\s+)?eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"), hints=("eyJ",)),
    Detector("api_key", "[API_KEY]", None, re.compile(
        r"(?<![A-Za-z0-9_-])(?:sk|pk|rk)-(?:proj-|live-|test-)?[A-Za-z0-9_-]{16,}"), hints=("sk-", "pk-", "rk-")),
    Detector("github_token", "[API_KEY]", None, re.compile(r"(?<![A-Za-z0-9_])gh[pousr]_[A-Za-z0-9]{20,}"), hints=("ghp_", "gho_", "ghu_", "ghs_", "ghr_")),
    Detector("aws_key", "[API_KEY]", None, re.compile(r"(?<![A-Za-z0-9])AKIA[0-9A-Z]{16}(?![A-Za-z0-9])"), hints=("AKIA",)),
    Detector("bearer", "[TOKEN]", None, re.compile(r"(?<![A-Za-z0-9])Bearer\s+[A-Za-z0-9._~+/-]{20,}=*"), hints=("Bearer",)),
    Detector("email", "[EMAIL]", None, re.compile(
        r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}(?![A-Za-z0-9_])"), hints=("@",)),
)


_IBAN = Detector(
    "iban", "[IBAN]", None, re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}[0-9]{2}(?:[ -]?[A-Z0-9]){11,30}"), _stdnum(_iban),
    label=_kw(r"iban|konto|compte|cuenta|conto|rekening|account|tilinumero|bank"), min_digits=2, shrink=True,
    keep_rejected="replace",  # fail closed: the IBAN shape (country, check digits, groups) names it, as a label would
)


def _id(kind: str, region: str, body: str, validate: Callable[[str], bool], label: str, min_digits: int,
        needs_label: Literal["never", "bare", "always"] = "never", flags: int = 0, strip: str = " ./-") -> Detector:
    return Detector(kind, "[NATIONAL_ID]", region, _rx(body, flags), validate, strip, _kw(label), needs_label,
                    min_digits=min_digits)


# Before cards: long IDs whose structure (birth date, check digits) is stronger evidence than a Luhn digit.
_LONG_IDS: tuple[Detector, ...] = (
    _id("cn_ric", "CN", r"[0-9]{6} ?[0-9]{8} ?[0-9]{3}[0-9Xx]",
        _stdnum(_cn_ric), r"身份证|身份證|居民身份|\bid\b|identity", 17),
    _id("fr_nir", "FR", r"[0-9] ?[0-9]{2} ?[0-9]{2} ?(?:[0-9]{2}|2[ABab]) ?[0-9]{3} ?[0-9]{3} ?[0-9]{2}", _stdnum(_fr_nir),
        r"s[ée]curit[ée] sociale|\bnir\b|insee|vitale|s[ée]cu\b", 15),
    _id("kr_rrn", "KR", r"[0-9]{6}-?[0-9]{7}", _stdnum(_kr_rrn), r"주민|등록번호|\brrn\b|resident registration", 13,
        "bare"),
    _id("ch_ssn", "CH", r"[0-9]{3}[ .]?[0-9]{4}[ .]?[0-9]{4}[ .]?[0-9]{2}", _stdnum(_ch_ssn),
        r"\bahv|\bavs\b|sozialversicherung|assurance sociale", 13),
)


_CARD = Detector(
    "card", "[CARD]", None, _rx(r"(?<!\+)(?:[0-9][ -]?){12,18}[0-9]"), _card_ok,
    label=_kw(r"card|karte|carte|tarjeta|carta|kaart|kort|karta|cart[ãa]o|卡|カード|카드"), min_digits=13,
)


_IDS: tuple[Detector, ...] = (
    _id("it_cf", "IT", r"[A-Z]{6}[0-9LMNPQRSTUV]{2}[A-EHLMPRST][0-9LMNPQRSTUV]{2}[A-Z][0-9LMNPQRSTUV]{3}[A-Z]",
        _stdnum(_it_cf), r"codice fiscale|\bcf\b|tessera sanitaria", 0, flags=re.IGNORECASE),
    _id("es_nie", "ES", r"[XYZ][ -]?[0-9]{7}[ -]?[A-Z]", _stdnum(_es_nie), r"\bnie\b|extranjer", 7, flags=re.IGNORECASE),
    _id("es_dni", "ES", r"[0-9]{2}\.?[0-9]{3}\.?[0-9]{3}[ -]?[A-Z]", _stdnum(_es_dni), r"\bdni\b|\bnif\b|documento", 8,
        flags=re.IGNORECASE),
    _id("tw_id", "TW", r"[A-Z][0-9]{9}", _tw_id_ok, r"身分證|身份證|統一證號|居留證|\bid\b", 9),
    _id("in_pan", "IN", r"[A-Z]{3}[ABCFGHJLPT][A-Z][0-9]{4}[A-Z]", _stdnum(_in_pan), r"\bpan\b|permanent account", 4),
    _id("uk_nino", "GB", r"[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?[0-9]{2} ?[0-9]{2} ?[0-9]{2} ?[A-D]", _nino_ok,
        r"national insurance|\bni\b|\bnino\b", 6),
    _id("fi_hetu", "FI", r"[0-9]{6}[-+A-FU-Y][0-9]{3}[0-9A-Y]", _stdnum(_fi_hetu), r"henkilötunnu|\bhetu\b|personbeteckning",
        6, strip=""),  # the century sign is part of the number
    _id("be_nn", "BE", r"[0-9]{2}\.?[0-9]{2}\.?[0-9]{2}[ -]?[0-9]{3}\.?[0-9]{2}", _stdnum(_be_nn),
        r"registre national|rijksregister|num[ée]ro national|national number|\bnn\b", 11, "bare"),
    _id("br_cpf", "BR", r"[0-9]{3}\.?[0-9]{3}\.?[0-9]{3}-?[0-9]{2}", _stdnum(_br_cpf), r"\bcpf\b|cadastro de pessoa", 11),
    _id("pl_pesel", "PL", r"[0-9]{11}", _stdnum(_pl_pesel), r"pesel", 11, "always"),
    _id("de_idnr", "DE", r"[0-9]{2} ?[0-9]{3} ?[0-9]{3} ?[0-9]{3}", _stdnum(_de_idnr),
        r"steuer|identifikationsnummer|id-?nr|tax ?id|\btin\b", 11, "bare"),
    _id("se_personnummer", "SE", r"(?:[0-9]{2})?[0-9]{6}[-+]?[0-9]{4}", _stdnum(_se_pnr),
        r"person ?(?:nummer|nr|number)|\bpnr\b", 10, "bare"),
    _id("ssn", "US", r"[0-9]{3}([- ]?)[0-9]{2}\1[0-9]{4}", _stdnum(_us_ssn), r"\bssn|social security|soc\.? ?sec", 9,
        "bare"),
    _id("nl_bsn", "NL", r"[0-9]{4}\.?[0-9]{2}\.?[0-9]{3}|[0-9]{3} [0-9]{3} [0-9]{3}", _stdnum(_nl_bsn),
        r"\bbsn|burgerservice|sofi", 9, "always"),
    _id("gb_nhs", "GB", r"[0-9]{3}[ -]?[0-9]{3}[ -]?[0-9]{4}", _stdnum(_gb_nhs), r"\bnhs", 10, "always"),
    _id("jp_my_number", "JP", r"[0-9]{4}[ -]?[0-9]{4}[ -]?[0-9]{4}", _stdnum(_jp_in), r"マイナンバー|個人番号|my ?number",
        12, "always"),
    _id("in_aadhaar", "IN", r"[0-9]{4}[ -]?[0-9]{4}[ -]?[0-9]{4}", _stdnum(_in_aadhaar),
        r"aadhaa?r|आधार|uidai|\buid\b", 12, "bare"),
)


DETECTORS: tuple[Detector, ...] = (*_SECRETS, _IBAN, *_LONG_IDS, _CARD, *_IDS)


KINDS: dict[str, str] = {**{d.kind: d.placeholder for d in DETECTORS}, PHONE_KIND: "[PHONE]",  # kind -> placeholder
                          "labelled_phone": "[PHONE]", "labelled_id": "[NATIONAL_ID]"}


@dataclass(frozen=True)
class Finding:
    """One replaced span of the original text."""

    start: int
    end: int
    kind: str
    placeholder: str
    region: str | None
