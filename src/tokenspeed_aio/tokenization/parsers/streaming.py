"""Tool calls out of a streamed reply: content is streamed as it comes, except text that
may be the start of a call marker (held back until it is decided); from a marker on the
text is buffered, and each call goes out as one delta once it is complete (at its
closing marker, or at the end of the reply). A buffered reply that does not parse as
calls goes out as content at the end, as the whole reply would."""

from __future__ import annotations

from tokenspeed_aio.tokenization.parsers.base import Extraction, ParsedCall, ToolParser


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` are a proper prefix of some marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""  # everything so far
        self.sent = 0  # characters of content sent
        self.start: int | None = None  # where the calls begin
        self.calls_sent = 0
        self.calls: list[ParsedCall] = []

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """(content to send now, calls complete now)."""
        self.text += delta
        if self.start is None:
            self.start = self._find_start()
            if self.start is None:
                hold = self._hold()
                content = self.text[self.sent : len(self.text) - hold]
                self.sent += len(content)
                return content, []
        content = self.text[self.sent : self.start]
        self.sent = self.start
        if not content.strip():  # the whitespace before a call is not content
            content = ""
        return content, self._complete_calls()

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of the reply: the content still held and the remaining calls."""
        if self.start is None:
            content, self.sent = self.text[self.sent :], len(self.text)
            return content, []
        found = self.parser.extract(self.text[self.start :])
        if not found.calls and not self.calls_sent:  # not calls after all: all content
            content, self.sent = self.text[self.sent :], len(self.text)
            return content, []
        new = found.calls[self.calls_sent :]
        self.calls_sent += len(new)
        self.calls.extend(new)
        return "", new

    def _find_start(self) -> int | None:
        for marker in self.parser.start_only:
            stripped = self.text.lstrip()
            if stripped.startswith(marker):
                return len(self.text) - len(stripped)
        found = [i for m in self.parser.start_markers if (i := self.text.find(m)) >= 0]
        return min(found) if found else None

    def _hold(self) -> int:
        if self.parser.start_only and not self.text.strip():
            return len(self.text)  # leading whitespace: a call may still begin
        return partial_suffix(self.text, self.parser.start_markers)

    def _complete_calls(self) -> list[ParsedCall]:
        closing = self.parser.closing_marker
        if closing is None or self.start is None:
            return []
        body = self.text[self.start :]
        end = body.rfind(closing)
        if end < 0:
            return []
        found: Extraction = self.parser.extract(body[: end + len(closing)])
        new = found.calls[self.calls_sent :]
        self.calls_sent += len(new)
        self.calls.extend(new)
        return new
