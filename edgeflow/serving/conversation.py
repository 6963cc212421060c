"""Bounded multi-turn context: the last N turns verbatim, older turns condensed into one line.

    condense(messages, keep_turns=4, summary_chars=240) -> Condensed(messages, condensed_turns)

OpenAI clients resend the whole conversation with every request, so without a bound a long chat
grows until it hits max_prompt_tokens and every further message is refused. A turn is a user
message plus everything after it up to the next user message (the assistant's answer); the
request's own user message is the last turn, so `keep_turns=4` keeps it and the three exchanges
before it. Leading system messages are always kept.

The summary is extractive (the opening words of each older question and answer), not generated:
running the model to summarise would add a full generation to the latency of every long chat,
and a 135M-parameter student summarises worse than it quotes. It is prefixed to the first kept
user message rather than sent as a system message, because chat templates differ on system
messages (SmolLM2's injects its default persona only when none is given; others reject a second one).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SUMMARY_PREFIX = "[Earlier in this conversation"
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Condensed:
    """The messages to render and how many older turns went into the summary line."""

    messages: list[dict[str, str]]
    condensed_turns: int
    summary: str | None


def split_turns(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[list[dict[str, str]]]]:
    """Leading system messages, then turns (each starts at a user message)."""
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        i += 1
    system, turns = messages[:i], []
    for m in messages[i:]:
        if m["role"] == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return system, turns


def _snippet(text: str, limit: int) -> str:
    text = _SPACE.sub(" ", text).strip()
    if len(text) <= limit:
        return text
    cut = text[: max(1, limit - 1)]
    if " " in cut[limit // 2:]:
        cut = cut[: cut.rfind(" ")]  # end on a word boundary when one is near
    return cut.rstrip() + "…"


def _turn_line(turn: list[dict[str, str]], limit: int) -> str:
    asked = next((m["content"] for m in turn if m["role"] == "user"), "")
    answered = " ".join(m["content"] for m in turn if m["role"] == "assistant")
    half = max(8, limit // 2)
    line = f"Q: {_snippet(asked, half)}" if asked else ""
    if answered:
        line += (" " if line else "") + f"A: {_snippet(answered, half)}"
    return line


def summary_line(turns: list[list[dict[str, str]]], max_chars: int) -> str:
    """One line naming the older turns, newest kept first when they do not all fit in max_chars."""
    head = f"{SUMMARY_PREFIX} ({len(turns)} earlier turn{'s' if len(turns) != 1 else ''}, condensed):"
    # room for the closing "]" and a "(N oldest omitted) " note, so the cut never lands on the newest turn
    budget = max_chars - len(head) - 2 - len(f"({len(turns)} oldest omitted) ")
    per_turn = max(24, budget // len(turns))
    lines: list[str] = []
    used = 0
    for turn in reversed(turns):  # the most recent context matters most: fill from the newest
        line = _turn_line(turn, per_turn)
        if used + len(line) + 3 > budget:
            break
        lines.insert(0, line)
        used += len(line) + 3
    omitted = len(turns) - len(lines)
    body = " | ".join(lines)
    if omitted:
        body = f"({omitted} oldest omitted) " + body if body else f"({omitted} omitted)"
    return _snippet(f"{head} {body}]", max_chars)


def condense(messages: list[dict[str, str]], keep_turns: int, summary_chars: int) -> Condensed:
    """Keep system messages and the last `keep_turns` turns; fold older turns into one summary line."""
    if keep_turns < 1:
        raise ValueError(f"keep_turns={keep_turns}: must be at least 1 (the request's own message)")
    system, turns = split_turns(messages)
    if len(turns) <= keep_turns:
        return Condensed(list(messages), 0, None)
    older, kept = turns[:-keep_turns], turns[-keep_turns:]
    summary = summary_line(older, summary_chars)
    first = dict(kept[0][0])
    first["content"] = f"{summary}\n\n{first['content']}"
    out = system + [first] + kept[0][1:] + [m for turn in kept[1:] for m in turn]
    return Condensed(out, len(older), summary)
