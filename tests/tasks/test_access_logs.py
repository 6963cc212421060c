import json
from datetime import datetime, timezone

from tasks.access_logs import ingest, log_files, normalize, scrub
from tasks.config import REPO_ROOT

LOGS = REPO_ROOT / "data" / "access_logs"

# A second, independent list: literal fragments of the PII planted in the sample log (see its README).
PLANTED = ["@example.com", "@example.org", "555-0132", "555-0199", "7946 0958", "4111 1111", "sk-", "ghp_", "eyJ", "-45-6789"]


def test_sample_log_counts_match_its_readme():
    records, rep = ingest(log_files(LOGS))
    assert (rep.lines, rep.malformed, rep.feedback) == (120, 5, 3)
    assert (rep.exact_duplicates, rep.near_duplicates, rep.dropped_too_long) == (6, 4, 2)
    assert rep.records_with_pii == 10
    assert rep.pii_replaced == {"email": 2, "phone": 3, "ssn": 1, "card": 1, "api_key": 1, "github_token": 1, "jwt": 1}
    assert rep.kept == len(records) == 112 - 6 - 4 - 2


def test_no_pii_survives_by_both_pattern_sets():
    records, _ = ingest(log_files(LOGS))
    blob = json.dumps(records)
    for text in (m["content"] for r in records for m in r["messages"]):
        assert scrub(text)[1] == {}, text
    for fragment in PLANTED:
        assert fragment not in blob, fragment
    assert "[EMAIL]" in blob and "[PHONE]" in blob and "[CARD]" in blob and "[API_KEY]" in blob and "[NATIONAL_ID]" in blob


def test_time_window_and_long_entries():
    _, rep = ingest(log_files(LOGS), since=datetime(2026, 11, 30, tzinfo=timezone.utc))
    assert rep.kept == 0 and rep.outside_window == 112
    records, rep = ingest(log_files(LOGS), max_words=50, drop_over_words=100_000)
    assert rep.dropped_too_long == 0 and rep.truncated >= 2
    assert max(len(m["content"].split()) for r in records for m in r["messages"]) <= 50


def test_scrub_keeps_ordinary_numbers_and_replaces_typed():
    text, found = scrub("Order 1234 5678 9012 3456 ships in 3 days; call +1 415-555-0132 or mail a.b@corp.io")
    assert "1234 5678 9012 3456" in text  # fails the Luhn check: not a card
    assert "[PHONE]" in text and "[EMAIL]" in text and found == {"phone": 1, "email": 1}
    assert scrub("The year 2026 had 365 days.")[1] == {}


def test_normalize_makes_near_duplicates_equal():
    assert normalize("What is  the capital of France?") == normalize("what is the capital of france")
