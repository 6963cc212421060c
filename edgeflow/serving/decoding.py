"""From engine tokens to the text and logprobs a client receives: incremental decoding, stop strings.

    d = TextStream(tokenizer, stop=["\\n\\n"]); for tok in tokens: text, done = d.push(tok); ...; d.flush()

* Text is produced by decoding the whole generated id list after each token and sending the new
  suffix, held back while it ends in an incomplete UTF-8 sequence, so byte-level BPE pieces of a
  multi-byte character render right.
* Stop strings are matched on that text, not on tokens: a stop string that spans several tokens is
  found, the text is cut exactly before it (OpenAI leaves it out), and while the text ends in a prefix
  of a stop string that prefix is held back, so a stream never sends characters it must take back.
* Logprob entries of the tokens behind a delta travel with it, so a streamed chunk's logprobs are
  exactly the tokens whose text it carries (the last chunk carries those of held-back text).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class IncrementalDecoder:
    """Decode the whole id list after each token; emit only the new suffix."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the token carrying the rest
        return self._advance(text)

    def flush(self) -> str:
        return self._advance(self._decode())

    def _advance(self, text: str) -> str:
        # Byte-level BPE decodes prefix-stably, so `text` extends what was sent; were it ever not
        # to, the client keeps what it already has and the non-streaming answer (built from the
        # same deltas) stays identical to the stream.
        delta = text[len(self.emitted):]
        self.emitted += delta
        return delta


class StopMatcher:
    """Cut text at the first occurrence of any stop string, across deltas."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string was reached)."""
        buf = self.pending + delta
        if not self.stops:
            self.pending = ""
            return buf, False
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:  # the longest suffix of buf that a stop string starts with
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Piece:
    """Text to send and the tokens (with logprobs, when asked) it came from."""

    text: str
    tokens: list[Any] = field(default_factory=list)


class TextStream:
    """IncrementalDecoder + StopMatcher + the logprob entries behind each piece of text."""

    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopMatcher(stop or [])
        self.tokens: list[Any] = []
        self.stopped = False
        self.tokenizer = tokenizer

    def push(self, token: Any) -> Piece | None:
        """A piece to send (None: nothing yet); sets `stopped` when a stop string was reached."""
        self.tokens.append(token)
        text, hit = self.stops.push(self.decoder.push(token))
        if hit:
            self.stopped = True
            return self._take(text)
        return self._take(text) if text else None

    def flush(self) -> Piece:
        """What is left when generation ends without a stop string."""
        text = self.decoder.flush()
        if self.stopped:
            return self._take("")
        text, hit = self.stops.push(text)
        self.stopped = hit
        return self._take(text + ("" if hit else self.stops.flush()))

    def _take(self, text: str) -> Piece:
        piece = Piece(text, self.tokens)
        self.tokens = []
        return piece

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([int(token)], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat_logprobs(stream: TextStream, tokens: list[Any]) -> dict[str, Any] | None:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    if not tokens or getattr(tokens[0], "logprob", None) is None:
        return None

    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = stream.token_text(tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**entry(t, t.logprob), "top_logprobs": [entry(a, lp) for a, lp in t.top_logprobs]}
                        for t in tokens]}


def completion_logprobs(stream: TextStream, tokens: list[Any], offset: int) -> dict[str, Any] | None:
    """Legacy completions `logprobs`: {tokens, token_logprobs, top_logprobs, text_offset}."""
    if not tokens or getattr(tokens[0], "logprob", None) is None:
        return None
    texts = [stream.token_text(t) for t in tokens]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{stream.token_text(a): lp for a, lp in t.top_logprobs} for t in tokens],
        "text_offset": offsets,
    }
