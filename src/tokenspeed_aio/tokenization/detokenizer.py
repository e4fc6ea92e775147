"""Incremental detokenization and stop strings, per request, in the frontend.

Decoding a window instead of the whole output keeps each step O(1): text is
emitted once the window decodes to more than its prefix and does not end in an
incomplete UTF-8 sequence (U+FFFD), so multi-byte characters split across tokens
and tokenizers whose pieces depend on their left neighbour both come out right.

    ids:  ... prompt tail | out0 out1 ... out_k
                ^prefix    ^read        (decode(prefix:) minus decode(prefix:read))
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenspeed_aio.tokenization.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens that seed the window


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)

    def step(self, new_ids: Sequence[int]) -> str:
        """Text the new tokens complete (may be empty while a character is split)."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix : self.read], self.skip)
        text = decode(self.ids[self.prefix :], self.skip)
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        if len(self.ids) > 4 * CONTEXT_TOKENS:  # keep the window small
            drop = self.prefix
            self.ids = self.ids[drop:]
            self.prefix, self.read = 0, self.read - drop
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of the stream: whatever is still held (an incomplete character)."""
        text = self.tokenizer.decode(self.ids[self.prefix :], self.skip)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip)
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text) :]


class StopStrings:
    """Finds the first stop string in the generated text. While streaming, the last
    ``longest - 1`` characters are held back: they may be the start of a stop string."""

    def __init__(self, stops: Sequence[str], include_in_output: bool) -> None:
        self.stops = tuple(stops)
        self.include = include_in_output
        self.hold = max((len(s) for s in stops), default=1) - 1

    def check(self, text: str, new_len: int) -> tuple[str, str] | None:
        """(truncated text, matched stop) if a stop string ends within the new text."""
        start = max(0, len(text) - new_len - self.hold)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        return text[: i + len(stop) if self.include else i], stop

    def releasable(self, text: str, finished: bool) -> int:
        """How much of the text may be shown now."""
        return len(text) if finished else max(0, len(text) - self.hold)
