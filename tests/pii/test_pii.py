import glob
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from phonenumbers import Leniency, PhoneNumberMatcher
from stdnum import iban, luhn

import edgeflow.calibration.access_logs
import edgeflow.pii as pii
from edgeflow.pii import api, detectors, labels, phones
from edgeflow.paths import REPO_ROOT
from edgeflow.pii import COVERED_REGIONS, DETECTORS, KINDS, PLACEHOLDERS, Scrubber, find, scrub, scrub_value
from tools import make_planted

FIXTURE = REPO_ROOT / "data" / "pii" / "planted.jsonl"
RECORDS = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
PLANTED = [r for r in RECORDS if not r["decoy"]]
DECOYS = [r for r in RECORDS if r["decoy"]]
# Bare IDs of kinds replaced only next to a word naming them (one check digit on bare digits: see edgeflow/pii/);
# the fixture plants two of them without such a word, on purpose.
LABEL_ONLY_WHEN_BARE = {"ssn", "de_idnr", "se_personnummer", "kr_rrn", "in_aadhaar", "nl_bsn", "pl_pesel", "gb_nhs",
                        "jp_my_number"}
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


MAKE = make_planted


# --- the fixture itself ---------------------------------------------------------------------------------


def test_fixture_is_what_its_generator_writes_and_big_enough():
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in MAKE.build())
    assert text == FIXTURE.read_text(encoding="utf-8")  # deterministic: rerun `python -m tools.make_planted` after editing it
    assert len(PLANTED) >= 150 and len(DECOYS) >= 50
    regions = {s["region"] for r in PLANTED for s in r["secrets"]}
    assert set(COVERED_REGIONS) <= regions
    assert {"en", "de", "fr", "es", "ja", "zh", "ko", "hi-en", "pt"} <= {r["lang"] for r in RECORDS}
    for r in PLANTED:
        assert r["secrets"] and all(s["value"] in r["text"] for s in r["secrets"]), r


def test_planted_check_digits_are_valid_by_stdnum():
    validators = {"iban": iban.is_valid, "card": luhn.is_valid}
    for r in PLANTED:
        for s in r["secrets"]:
            if s["kind"] in validators:  # valid, except the near misses planted to be replaced all the same
                valid = validators[s["kind"]](s["value"].replace(" ", "").replace("-", ""))
                assert valid == (s["format"] != "labelled_invalid"), s


# --- recall ---------------------------------------------------------------------------------------------


def test_every_planted_secret_is_replaced_except_bare_ids_without_their_word():
    misses, wrong_placeholder = [], []
    placeholder = {"phone": "[PHONE]", "national_id": "[NATIONAL_ID]", "iban": "[IBAN]", "card": "[CARD]",
                   "email": "[EMAIL]", "api_key": "[API_KEY]", "token": "[TOKEN]"}
    for r in PLANTED:
        out, _ = scrub(r["text"])
        for s in r["secrets"]:
            if s["value"] in out:
                misses.append(s)
            elif placeholder[s["kind"]] not in out:
                wrong_placeholder.append((s, out))
    # measured: 2 misses of 225 (a KR RRN and an Aadhaar number, bare digits with no word naming them)
    assert all(s["kind"] == "national_id" and s["type"] in LABEL_ONLY_WHEN_BARE and s["format"] == "compact"
               for s in misses), misses
    assert len(misses) <= 2
    assert len(wrong_placeholder) <= 2, wrong_placeholder


@pytest.mark.parametrize("number", [
    "+4915112345678", "015112345678", "090-1234-5678", "13812345678", "+86 138 1234 5678", "(555) 123-4567",
    "5551234567", "+44 20 7946 0958", "+1 415-555-0132", "06 12 34 56 78", "+33612345678", "010-2000-1234",
    "0912 345 678", "+91 98765 43210", "(11) 96123-4567", "+48 512 345 678", "070-123 45 67", "312 345 6789",
])
def test_phone_numbers_in_national_and_international_formats(number):
    out, counts = scrub(f"Please call me on {number} tomorrow.")
    assert out == "Please call me on [PHONE] tomorrow." and counts == {"phone": 1}


def test_bare_digits_are_phones_unless_a_unit_or_currency_makes_them_a_quantity():
    assert scrub("明天见，有事13812345678。") == ("明天见，有事[PHONE]。", {"phone": 1})
    assert scrub("Dinner at 8? If plans change: 2015557108") == ("Dinner at 8? If plans change: [PHONE]", {"phone": 1})
    for text in ("这个城市有21893095人。", "Downloaded 1073741824 bytes.", "It sold for $2015557108 in total.",
                 "The video passed 123456789 views."):
        assert scrub(text) == (text, {}), text
    strict = Scrubber(bare_phone_needs_word=True)
    assert strict.scrub("明天见，有事13812345678。")[1] == {}
    assert strict.scrub("我的手机13812345678。")[1] == {"phone": 1}


def test_a_number_next_to_a_phone_number_does_not_hide_it():
    # libphonenumber reads "0151 23456789 30" as one candidate and finds nothing; the window is retried trimmed
    assert scrub("we meet at 0151 23456789 30 minutes later") == ("we meet at [PHONE] 30 minutes later", {"phone": 1})
    assert scrub("ring (415) 555-0199 30 minutes") == ("ring [PHONE] 30 minutes", {"phone": 1})
    assert scrub("in 30 0151 23456789 ok") == ("in 30 [PHONE] ok", {"phone": 1})


def test_full_width_digits_are_found_and_replaced_in_place():
    text = "携帯は０９０－１２３４－５６７８です。"
    assert scrub(text) == ("携帯は[PHONE]です。", {"phone": 1})


@pytest.mark.parametrize("text, kind, placeholder", [
    ("Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "jwt", "[TOKEN]"),
    ("key sk-proj-abcdefghijklmnop1234 here", "api_key", "[API_KEY]"),
    ("このAPIキーsk-abcdefghijklmnopqrstuvwxyzは有効？", "api_key", "[API_KEY]"),
    ("token ghp_abcdefghijklmnopqrstuvwxyz0123456789", "github_token", "[API_KEY]"),
    ("AKIAABCDEFGHIJKLMNOP is my key id", "aws_key", "[API_KEY]"),
    ("Authorization: Bearer abcdefghijklmnopqrstuvwxyz012345", "bearer", "[TOKEN]"),
    ("我的邮箱是li.wei@example.cn谢谢", "email", "[EMAIL]"),
    ("IBAN DE89 3704 0044 0532 0130 00 EUR", "iban", "[IBAN]"),
    ("card 4111 1111 1111 1111", "card", "[CARD]"),
])
def test_secrets_of_each_kind(text, kind, placeholder):
    out, counts = scrub(text)
    assert counts == {kind: 1} and placeholder in out, (out, counts)


@pytest.mark.parametrize("text, kind", [
    ("My SSN is 123-45-6789.", "ssn"),
    ("NI number AB 12 34 56 C please", "uk_nino"),
    ("My NHS number is 943 476 5919.", "gb_nhs"),
    ("Steuer-ID 36 574 261 809", "de_idnr"),
    ("NIR 1 84 12 76 451 089 46", "fr_nir"),
    ("DNI 12345678Z", "es_dni"),
    ("NIE X1234567L", "es_nie"),
    ("codice fiscale RCCMNL83S18D969H", "it_cf"),
    ("Mijn BSN is 111222333.", "nl_bsn"),
    ("personnummer 811228-9874", "se_personnummer"),
    ("PESEL 44051401359", "pl_pesel"),
    ("numéro national 85.07.30-033.28", "be_nn"),
    ("AHV 756.9217.0769.85", "ch_ssn"),
    ("henkilötunnus 131052-308T", "fi_hetu"),
    ("身份证11010519491231002X", "cn_ric"),
    ("マイナンバー 6214 9832 0257", "jp_my_number"),
    ("주민등록번호 900101-1234568", "kr_rrn"),
    ("身分證字號A123456789", "tw_id"),
    ("Aadhaar 2345 6789 0124", "in_aadhaar"),
    ("PAN ABCPE1234F", "in_pan"),
    ("CPF 123.456.789-09", "br_cpf"),
])
def test_national_ids_by_region(text, kind):
    out, counts = scrub(text)
    assert counts == {kind: 1} and "[NATIONAL_ID]" in out, (out, counts)


def test_taiwan_checksum_known_answers():
    assert detectors._tw_id_ok("A123456789") and detectors._tw_id_ok("F131104093")
    assert not detectors._tw_id_ok("A123456788") and not detectors._tw_id_ok("A323456789")


# --- precision ------------------------------------------------------------------------------------------


def test_decoys_keep_every_number():
    touched = []
    for r in DECOYS:
        out, counts = scrub(r["text"])
        if counts or any(k not in out for k in r["keep"]):
            touched.append((r["decoy_type"], r["text"], out))
    assert not touched  # measured: 0 of 52 decoys touched


_NEAR_MISS_KINDS = ["de_idnr", "fr_nir", "es_dni", "it_cf", "nl_bsn", "pl_pesel", "cn_ric", "jp_my_number", "kr_rrn",
                    "tw_id", "in_aadhaar", "br_cpf", "be_nn", "ch_ssn", "gb_nhs", "se_personnummer"]
_WORDS = {"de_idnr": "Steuer-ID", "fr_nir": "NIR", "es_dni": "DNI", "it_cf": "codice fiscale", "nl_bsn": "BSN",
          "pl_pesel": "PESEL", "cn_ric": "身份证", "jp_my_number": "マイナンバー", "kr_rrn": "주민등록번호", "tw_id": "身分證",
          "in_aadhaar": "Aadhaar", "br_cpf": "CPF", "be_nn": "numéro national", "ch_ssn": "AHV", "gb_nhs": "NHS",
          "se_personnummer": "personnummer"}


@FAST
@given(kind=st.sampled_from(_NEAR_MISS_KINDS), seed=st.integers(0, 2**32 - 1), variant=st.integers(0, 1))
def test_one_changed_digit_named_as_an_id_is_still_replaced_and_unnamed_it_is_not_that_id(kind, seed, variant):
    """Fail closed: a word naming the ID makes a number that fails its check a [NATIONAL_ID] all the same (a
    mistyped ID is still somebody's); without the word the check decides, and it is not read as this ID."""
    rng = random.Random(seed)
    value = MAKE.gen_id(kind, rng, variant)
    det = next(d for d in DETECTORS if d.kind == kind)
    compact = value.translate(labels._strip_table(det.strip))
    assert det.validate(compact.upper()), value
    text = f"{_WORDS[kind]} {value}"
    assert find(text) and find(text)[0].kind == kind
    digits = [i for i, c in enumerate(value) if c.isdigit()]
    i = rng.choice(digits)
    wrong = value[:i] + str((int(value[i]) + rng.randint(1, 9)) % 10) + value[i + 1:]
    wrong_compact = wrong.translate(labels._strip_table(det.strip))
    if det.validate(wrong_compact.upper()):
        return  # a few changes keep a weak checksum valid (e.g. a Luhn digit swap); nothing to reject
    out, counts = scrub(f"{_WORDS[kind]} {wrong}")
    assert wrong not in out and "[NATIONAL_ID]" in out, (wrong, out, counts)
    _, counts = scrub(f"see {wrong}")
    assert kind not in counts, (wrong, counts)


def test_failing_checks_with_a_word_naming_them_are_replaced_and_without_one_stay():
    assert scrub("BSN 123456789 uit het voorbeeld") == ("BSN [NATIONAL_ID] uit het voorbeeld", {"nl_bsn": 1})
    assert scrub("The card number 4111 1111 1111 1112 is fake") == ("The card number [CARD] is fake", {"card": 1})
    assert scrub("IBAN DE00 3704 0044 0532 0130 00 EUR") == ("IBAN [IBAN] EUR", {"iban": 1})  # the shape names it
    assert scrub("Order 1234 5678 9012 3456 ships in 3 days")[1] == {}  # fails Luhn, named as an order


def test_a_validator_that_raises_counts_as_a_hit():
    """python-stdnum's resident-ID check raises KeyError for a checksum-valid number whose region code its table
    lacks; such a number is scrubbed, not passed through."""
    value = MAKE.gen_ric_missing_region(random.Random(7))
    with pytest.raises(KeyError):
        detectors._cn_ric.is_valid(value)
    for text in (f"我的身份证号是{value}", f"身份证：{value}，请帮我填表。", f"{value}"):
        out, counts = scrub(text)
        assert value not in out and "[NATIONAL_ID]" in out and counts == {"cn_ric": 1}, (text, out, counts)


def test_a_phone_matcher_that_raises_masks_the_whole_digit_window(monkeypatch):
    """Fail closed like the ID validators: libphonenumber raising on some input must not pass the number through."""
    from edgeflow.pii import scrubber

    text = "Call me tomorrow on 030 901820 54 after lunch."
    assert scrub(text) == ("Call me tomorrow on [PHONE] after lunch.", {"phone": 1})

    def broken(*args, **kwargs):
        raise IndexError("a matcher bug")

    monkeypatch.setattr(scrubber, "PhoneNumberMatcher", broken)
    out, counts = scrub(text)
    assert "901820" not in out and "[PHONE]" in out and counts == {"phone": 1}, out


@pytest.mark.parametrize("region, lang, template", MAKE.UNASSIGNED_PHONE_T)
def test_a_number_named_as_a_phone_number_is_replaced_even_in_an_unassigned_range(region, lang, template):
    import phonenumbers

    value = MAKE.gen_unassigned_phone(region, random.Random(11))
    assert not phonenumbers.is_valid_number(phonenumbers.parse(value, region))
    out, counts = scrub(template.format(v=value))
    assert value not in out and "[PHONE]" in out, (out, counts)


@pytest.mark.parametrize("text, placeholder", [
    ("my ID number is 12345678", "[NATIONAL_ID]"), ("Ausweisnummer: T22000129", None),
    ("护照号码是E12345678", None), ("주민등록번호는 123456-1234567", "[NATIONAL_ID]"),
    ("My phone number is 100 1234 5678.", "[PHONE]"), ("電話番号は 0100-123-4567 です", "[PHONE]"),
])
def test_labelled_numbers_in_the_fleets_languages(text, placeholder):
    out, _ = scrub(text)
    digits = "".join(ch for ch in text if ch.isdigit())
    if placeholder is None:  # a letter-led passport or ID card number: the digits after the letter are replaced
        assert digits not in "".join(ch for ch in out if ch.isdigit()) and "[NATIONAL_ID]" in out, out
    else:
        assert placeholder in out and not any(ch.isdigit() for ch in out), out


def test_project_clean_text_is_left_alone():
    strings, replaced = 0, {}
    for pattern in ("data/corpora/*.jsonl", "data/eval/*.jsonl"):
        for path in sorted(glob.glob(str(REPO_ROOT / pattern))):
            for line in open(path, encoding="utf-8"):
                _, counts = scrub_value(json.loads(line))
                strings += 1
                pii.merge_counts(replaced, counts)
    assert strings >= 900
    assert replaced == {}  # measured: 0 replacements in 903 records (2,596 strings, ~73k words)


def test_plain_numbers_in_prose_stay():
    for text in ("The year 2026 had 365 days.", "It costs $1,299.99 or 1.234.567 €.", "40 × 75 = 3000, and 3000 / 100 = 30.",
                 "The table has 48213907 rows.", "Meeting on 2026-11-29 at 14:30, log 2026-11-29 01:23:45.",
                 "订单号20241129001还没有发货。", "Order #48213907 is late"):
        assert scrub(text) == (text, {}), text


# --- phone matcher pruning ------------------------------------------------------------------------------

_WINDOW_CHARS = st.text(alphabet="0123456789 -.()/+", min_size=7, max_size=22)


@FAST
@given(window=_WINDOW_CHARS)
def test_region_pruning_only_skips_regions_that_find_nothing(window):
    text = f"call {window} now"
    for w in phones._PHONE_WINDOW.finditer(text):
        groups = [(g.start(), g.end()) for g in phones._DIGIT_GROUP.finditer(w.group(0))]
        spans = labels._group_spans(w.group(0), groups) | {"".join(w.group(0)[s:e] for s, e in groups)}
        lo = max(0, w.start() - phones._PHONE_CTX)
        sub = text[lo:w.end() + phones._PHONE_CTX]
        for rule in api._DEFAULT._rules:
            if any(rule.may_match(d) for d in spans):
                continue
            found = [m.raw_string for m in PhoneNumberMatcher(sub, rule.region, leniency=Leniency.VALID)
                     if lo + m.start >= w.start() and lo + m.end <= w.end() and "+" not in m.raw_string
                     and sum(c.isdigit() for c in m.raw_string) >= pii.PHONE_MIN_DIGITS]
            assert not found, (rule.region, w.group(0), found)


def test_pruning_replaces_at_least_what_trying_every_region_replaces_on_the_fixture():
    unpruned = Scrubber(prune_regions=False)
    for r in RECORDS:
        covered = {i for f in find(r["text"]) for i in range(f.start, f.end)}
        assert {i for f in unpruned.find(r["text"]) for i in range(f.start, f.end)} <= covered, r["text"]


# --- scrub_value ----------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
    | st.sampled_from(["+49 151 23456789", "jane@example.com", "SSN 123-45-6789", "4111 1111 1111 1111"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _same_shape(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_shape(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same_shape(x, y) for x, y in zip(a, b))
    if isinstance(a, str):
        return isinstance(b, str)
    return a is b or a == b or (a != a and b != b)  # NaN


@FAST
@given(value=JSON)
def test_scrub_value_never_raises_and_keeps_the_shape(value):
    before = json.dumps(value)
    out, counts = scrub_value(value)
    assert json.dumps(value) == before  # the input is not modified
    assert _same_shape(value, out)
    assert all(isinstance(k, str) and v > 0 for k, v in counts.items())
    assert "123-45-6789" not in json.dumps(out) and "jane@example.com" not in json.dumps(out)


def test_scrub_value_walks_nested_values_and_leaves_keys():
    value = {"jane@example.com": [{"note": "call +49 151 23456789"}, 3, None, True, 1.5, ["SSN 123-45-6789"]]}
    out, counts = scrub_value(value)
    assert out == {"jane@example.com": [{"note": "call [PHONE]"}, 3, None, True, 1.5, ["SSN [NATIONAL_ID]"]]}
    assert counts == {"phone": 1, "ssn": 1}
    assert scrub_value("mail jane@example.com") == ("mail [EMAIL]", {"email": 1})
    assert scrub_value(10**40) == (10**40, {}) and scrub_value(None) == (None, {})


def test_scrub_value_deep_nesting_and_cycles():
    deep: list = ["a@example.com"]
    for _ in range(5000):
        deep = [deep]
    out, counts = scrub_value(deep)
    assert counts == {"email": 1}
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="contains itself"):
        scrub_value(cyclic)


# --- API, docs, speed -----------------------------------------------------------------------------------


def test_public_api_and_compatibility():
    assert edgeflow.calibration.access_logs.scrub is pii.scrub
    assert {"US", "GB", "DE", "FR", "ES", "IT", "NL", "SE", "PL", "CN", "JP", "KR", "TW", "IN", "BR"} <= set(COVERED_REGIONS)
    assert set(KINDS.values()) == set(PLACEHOLDERS)
    for kind in KINDS:  # the module docstring lists every kind it replaces
        assert kind in pii.__doc__, kind
    with pytest.raises(TypeError, match="scrub_value"):
        scrub(b"bytes")  # type: ignore[arg-type]


def test_secrets_are_matched_before_phone_numbers():
    out, counts = scrub("IBAN DE89 3704 0044 0532 0130 00, Karte 4111-1111-1111-1111, Tel. 030 1234567")
    assert counts == {"iban": 1, "card": 1, "phone": 1}, (out, counts)


def test_text_without_a_phone_length_digit_run_never_reaches_the_phone_matcher(monkeypatch):
    """What keeps a typical request cheap (its time per request is in BENCHMARKS.md#pii-scrubbing, not here): words and short
    numbers ("2024", "$30") never reach libphonenumber's matcher, the costliest detector; a phone number in the same
    text does."""
    from edgeflow.pii import scrubber

    words = ("the quick brown fox jumps over a lazy dog while we talk about distillation and quantization " * 20).split()
    request = {"messages": [{"role": "user", "content": " ".join(words[:70])},
                            {"role": "assistant", "content": " ".join(words[70:140])},
                            {"role": "user", "content": " ".join(words[140:200]) + " in 2024 for $30"}]}
    calls: list[str] = []
    real_phones = scrubber.Scrubber._phones
    monkeypatch.setattr(scrubber.Scrubber, "_phones", lambda self, *a: calls.append("phone") or real_phones(self, *a))
    out, counts = scrub_value(request)
    assert out == request and counts == {} and calls == [], calls
    request["messages"][2]["content"] += ", call me on +44 20 7946 0958"
    out, counts = scrub_value(request)
    assert calls and counts == {"phone": 1} and "7946" not in json.dumps(out), (calls, counts, out)
