"""PII and secret scrubbing for chat traffic: the one owner of what gets replaced, and how.

    python -m edgeflow.pii "Ruf mich an: 0151 12345678, IBAN DE89 3704 0044 0532 0130 00, mail jane@example.com"

The edge server scrubs every access-log record with `scrub_value` before writing it; ingestion
(`edgeflow.calibration.access_logs.ingest`) scrubs again with `scrub`, because logs written by older servers are raw.
Measured recall, false positives and speed: `python benchmarks/pii.py` (fixture: data/pii/planted.jsonl).

Covered, in the order applied (an earlier kind claims its characters first, so the digits of a card or an
IBAN are never re-read as a phone number):

  kind(s)                         placeholder     a candidate is replaced when
  jwt, bearer                     [TOKEN]         eyJ….….… (optionally after "Bearer"); "Bearer <20+ chars>"
  api_key, github_token, aws_key  [API_KEY]       sk-/pk-/rk- keys; gh[pousr]_ tokens; AKIA… access key ids
  email                           [EMAIL]         local@domain.tld
  iban                            [IBAN]          python-stdnum `iban` accepts it (country format + mod 97)
  cn_ric fr_nir kr_rrn ch_ssn     [NATIONAL_ID]   long IDs with a birth date and/or check digits, before cards
  card                            [CARD]          13-19 digits, a card issuer's prefix, Luhn check
  other national IDs (below)      [NATIONAL_ID]   a regex finds the shape, the python-stdnum validator accepts it
  phone                           [PHONE]         libphonenumber `PhoneNumberMatcher(text, region, Leniency.VALID)`
                                                  for each region of COVERED_REGIONS, on windows of >= 7 digits

  National IDs by region (python-stdnum module; "label" = only next to a word naming the ID):
    US ssn (us.ssn; 9 digits without dashes: label)
    GB uk_nino (prefix rules; the NINO has no check digit), gb_nhs (gb.nhs; label)
    DE de_idnr (de.idnr, Steuer-ID; 11 bare digits: label)    FR fr_nir (fr.nir)
    ES es_dni, es_nie (es.dni, es.nie)    IT it_cf (it.codicefiscale)    NL nl_bsn (nl.bsn; label)
    SE se_personnummer (se.personnummer; without "-": label)    PL pl_pesel (pl.pesel; label)
    BE be_nn (be.nn; 11 bare digits: label)    CH ch_ssn (ch.ssn, AHV 756…)    FI fi_hetu (fi.hetu)
    CN cn_ric (cn.ric, 18 characters)    JP jp_my_number (jp.in_; label)    KR kr_rrn (kr.rrn; without "-": label)
    TW tw_id (letter + 9 digits; python-stdnum has no module, the published checksum is implemented here)
    IN in_aadhaar (in_.aadhaar, Verhoeff; 12 bare digits: label), in_pan (in_.pan)    BR br_cpf (br.cpf)
  "Label" applies where one check digit on 9-12 bare digits would accept ~10% of random numbers, and to
  bare BE numbers (11 digits, like the mobile numbers of CN, KR and BR). Candidates with a label near are
  decided first, so "Steuer-ID 12345678901" is judged as a Steuer-ID even when another 11-digit check
  (CPF, PESEL, BE national number) happens to pass.

  Fail closed: a validator that raises counts as a hit; a candidate whose check fails is still replaced when
  a word naming its kind stands near it (a mistyped ID is still somebody's), and so is an IBAN-shaped string
  that fails its check; a number of plausible length right after a word naming it a phone number or an ID,
  in the fleet's languages ("我的手机号是…", "my ID number is …"), is replaced whatever libphonenumber or a
  checksum says of it (kinds labelled_phone, labelled_id).

  Candidates that keep their digits: a number whose check fails with no word naming it; a number right after
  "order", "invoice", "Bestellnummer", "注文番号", … (a reference number); digits written without "+", separators or a leading 0 that a unit or currency follows or
  precedes ("48213907 rows", "21893095人", "$1299000"), unless a word such as "call", "Handy", "电话",
  "전화" is near; a leading calendar date; digits next to "=", "×", "*", … (arithmetic).

Not covered: names, postal addresses, dates of birth on their own, passwords without a known prefix, phone
numbers of regions outside COVERED_REGIONS written in national format, numbers with fewer than 7 digits,
Korean RRNs issued since October 2020 (random digits, no check digit: only old-checksum ones are caught).

Matching runs on a folded copy of the text of the same length (full-width ASCII and other Unicode digits,
dashes and spaces mapped to ASCII), so "０９０－１２３４－５６７８" is found like "090-1234-5678" and
each replacement lands on the original characters.
"""
from __future__ import annotations

import functools
import re
import sys
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal

import phonenumbers
from phonenumbers import COUNTRY_CODE_TO_REGION_CODE, Leniency, PhoneMetadata, PhoneNumberMatcher
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

try:  # only to skip regions that cannot match (see _RegionRule); if absent, no region is skipped for it
    from phonenumbers.phonenumbermatcher import _formatting_rule_has_first_group_only as _first_group_only
    from phonenumbers.phonenumberutil import _choose_formatting_pattern_for_number as _choose_format
except ImportError:  # pragma: no cover
    _choose_format = _first_group_only = None  # type: ignore[assignment]
try:  # only to compile metadata patterns up front (see _compile_phone_patterns)
    from phonenumbers.re_util import re_compile
except ImportError:  # pragma: no cover
    re_compile = None  # type: ignore[assignment]

# The regions the fleet serves: national-format phone numbers and the national IDs above are covered for
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


# --------------------------------------------------------------------------------------------------------
# Folding: a same-length ASCII view of the text, so patterns are written once, for ASCII
# --------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------
# Detectors
# --------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------
# Phone numbers: libphonenumber's matcher, run only where it can find something
# --------------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------------
# Scrubber
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One replaced span of the original text."""

    start: int
    end: int
    kind: str
    placeholder: str
    region: str | None


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
            for m in PhoneNumberMatcher(sub, rule.region, leniency=self.leniency):
                s, e = lo + m.start, lo + m.end
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


# --------------------------------------------------------------------------------------------------------
# Labelled numbers: fail closed on what the user names
# --------------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------

_DEFAULT = Scrubber()


def find(text: str) -> list[Finding]:
    """Every PII span in text (start, end, kind, placeholder, region), by position."""
    return _DEFAULT.find(text)


def scrub(text: str) -> tuple[str, dict[str, int]]:
    """Replace PII and secrets with typed placeholders; returns the text and what was replaced, by kind."""
    return _DEFAULT.scrub(text)


def merge_counts(into: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    """Add counts into `into` (in place) and return it."""
    for k, v in counts.items():
        into[k] = into.get(k, 0) + v
    return into


def scrub_value(value: Any) -> tuple[Any, dict[str, int]]:
    """Scrub every string in a JSON value (dict/list/str/other; dict keys untouched): a new value and merged counts.

    Numbers, booleans and None pass through unchanged; tuples come back as lists. Iterative, so nesting depth
    is not limited by Python's recursion limit. Raises only for a container that contains itself, which no
    JSON value can.
    """
    counts: dict[str, int] = {}

    def leaf(v: Any) -> Any:
        if isinstance(v, str):
            text, found = _DEFAULT.scrub(v)
            merge_counts(counts, found)
            return text
        return v

    if not isinstance(value, (dict, list, tuple)):
        return leaf(value), counts
    root: Any = {} if isinstance(value, dict) else []
    # (source container, its copy, iterator over its items); a copy is filled as its items are visited
    stack = [(value, root, _items(value))]
    on_path = {id(value)}
    while stack:
        src, dst, items = stack[-1]
        step = next(items, None)
        if step is None:
            on_path.discard(id(src))
            stack.pop()
            continue
        key, child = step
        if isinstance(child, (dict, list, tuple)):
            if id(child) in on_path:
                raise ValueError(f"scrub_value: a {type(child).__name__} contains itself; JSON values cannot be cyclic")
            new: Any = {} if isinstance(child, dict) else []
            on_path.add(id(child))
            stack.append((child, new, _items(child)))
        else:
            new = leaf(child)
        if isinstance(dst, dict):
            dst[key] = new
        else:
            dst.append(new)
    return root, counts


def _items(container: dict | list | tuple) -> Iterator[tuple[Any, Any]]:
    return iter(container.items()) if isinstance(container, dict) else enumerate(container)


if __name__ == "__main__":
    for arg in sys.argv[1:] or [sys.stdin.read()]:
        out, found = scrub(arg)
        print(out)
        print(found, file=sys.stderr)
