"""The repetition figures that tell a demo answer from a loop (the engines' answers are exercised by the gate tests)."""
from __future__ import annotations

from edgeflow.evaluation.answers import PROMPTS, repetition, summary


def test_a_fluent_answer_is_not_degenerate() -> None:
    r = repetition("Seasons happen because Earth's axis is tilted, so each hemisphere leans toward the Sun for part of the year.")
    assert r["max_trigram_repeats"] == 1 and r["distinct_2"] == 1.0 and not r["degenerate"]


def test_a_loop_is_degenerate_by_its_trigrams_and_its_bigrams() -> None:
    r = repetition("To the total of total total total total total total total total")
    assert r["max_trigram_repeats"] == 6 and r["distinct_2"] == 0.4545 and r["degenerate"]  # 5 distinct of 11 bigrams
    # a 3-gram twice is allowed; a third time is not
    twice = repetition("one two three four one two three five six seven eight nine ten eleven")
    thrice = repetition("one two three four one two three five one two three six seven eight nine ten")
    assert twice["max_trigram_repeats"] == 2 and not twice["degenerate"]
    assert thrice["max_trigram_repeats"] == 3 and thrice["degenerate"]


def test_an_empty_answer_is_degenerate_and_the_summary_counts_it() -> None:
    empty, fine = repetition("   "), repetition("Water boils at a lower temperature high up a mountain.")
    assert empty["degenerate"] and empty["words"] == 0
    assert summary([empty, fine]) == {"answers": 2, "degenerate": 1, "distinct_2_mean": 0.5, "max_trigram_repeats": 1}


def test_five_fixed_prompts() -> None:
    assert len(PROMPTS) == 5 and len(set(PROMPTS)) == 5
