"""Multi-turn bounding: last N turns verbatim, older turns in one summary line."""
from __future__ import annotations

import pytest

from edgeflow.serving.conversation import SUMMARY_PREFIX, condense, split_turns


def _chat(n_turns: int, system: bool = True, words: int = 30) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "Be brief."}] if system else []
    for i in range(n_turns - 1):
        msgs.append({"role": "user", "content": f"question {i} " + "about tea " * words})
        msgs.append({"role": "assistant", "content": f"answer {i} " + "green tea " * words})
    msgs.append({"role": "user", "content": f"question {n_turns - 1} now"})
    return msgs


def test_short_chats_pass_through_unchanged():
    msgs = _chat(4)
    out = condense(msgs, keep_turns=4, summary_chars=240)
    assert out.messages == msgs and out.condensed_turns == 0 and out.summary is None


def test_older_turns_fold_into_one_bounded_line_before_the_kept_turns():
    msgs = _chat(10)
    out = condense(msgs, keep_turns=4, summary_chars=240)
    assert out.condensed_turns == 6
    assert out.messages[0] == msgs[0]  # the system message stays first and untouched
    kept = out.messages[1:]
    # the last 4 turns (3 exchanges + the new question) are kept verbatim except for the prefix on the first
    assert [m["role"] for m in kept] == ["user", "assistant"] * 3 + ["user"]
    assert kept[1:] == msgs[-7 + 1:]
    first = kept[0]["content"]
    summary, original = first.split("\n\n", 1)
    assert original == msgs[-7]["content"]
    assert summary.startswith(SUMMARY_PREFIX) and "6 earlier turns" in summary
    assert "\n" not in summary and len(summary) <= 240
    assert "question 5" in summary  # the newest condensed turn is quoted


def test_length_stays_bounded_however_long_the_chat():
    verbatim = sum(len(m["content"]) for m in condense(_chat(4), 4, 240).messages)  # nothing condensed yet
    sizes = [sum(len(m["content"]) for m in condense(_chat(n), 4, 240).messages) for n in (5, 50, 500)]
    # the kept turns are as long as 4 turns always are; the summary adds at most its 240 chars (+ "\n\n")
    # (+ a few chars: later turns have longer numbers in "question 48")
    assert all(verbatim < s <= verbatim + 242 + 12 for s in sizes), (verbatim, sizes)


def test_oldest_turns_are_named_when_they_do_not_fit():
    out = condense(_chat(60, words=3), keep_turns=2, summary_chars=120)
    assert "oldest omitted" in out.summary and len(out.summary) <= 120
    assert out.summary.endswith("A: answer 57…]")  # the newest condensed turn is whole, never cut


def test_turns_split_at_user_messages():
    system, turns = split_turns(_chat(3))
    assert len(system) == 1 and [len(t) for t in turns] == [2, 2, 1]


def test_keep_turns_must_be_positive():
    with pytest.raises(ValueError, match="keep_turns=0"):
        condense(_chat(3), keep_turns=0, summary_chars=240)
