"""Reasoning parsers: a reply's ``<think>...</think>`` part becomes ``reasoning_content``,
the rest ``content``; streamed, each delta is split as it comes (a partial tag at the end
of a delta is held back until the next one decides it).

``deepseek_r1``: a reply starts inside the think block (its chat template opens it in the
prompt; a ``<think>`` the model writes itself is dropped) and is reasoning until
``</think>``. ``qwen3``: inside from the start only when the rendered prompt left a
``<think>`` open; otherwise content until the model writes ``<think>``. A reply with no
tag at all -- Qwen3 with ``enable_thinking: false`` -- is all content. A reply under a
grammar starts outside the block whatever the parser: the grammar decides from its first
token whether a think block is written.
"""

from __future__ import annotations

from tokenspeed_aio.tokenization.parsers.streaming import partial_suffix

START, END = "<think>", "</think>"


def prompt_opens_block(prompt: str) -> bool:
    """Whether the rendered prompt ends inside a think block."""
    return prompt.rfind(START) > prompt.rfind(END)


class ReasoningParser:
    name = "base"
    always_inside = False

    def stream(self, prompt: str, constrained: bool = False) -> ReasoningStream:
        inside = not constrained and (self.always_inside or prompt_opens_block(prompt))
        return ReasoningStream(inside)

    def split(
        self, prompt: str, text: str, constrained: bool = False
    ) -> tuple[str | None, str | None]:
        """(reasoning, content) of a complete reply (None for an empty part)."""
        stream = self.stream(prompt, constrained)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    always_inside = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


class ReasoningStream:
    """Splits one streamed reply; ``feed`` and ``finish`` return (reasoning, content)."""

    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self.done = False  # past </think>: the rest is content
        self.at_start = True  # nothing assigned yet (a leading <think> is dropped)
        self.after_end = False  # newlines right after </think> are not content
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning, content = [], []
        while self.pending:
            if self.done:
                if self.after_end:
                    self.pending = self.pending.lstrip("\n")
                    if not self.pending:
                        break
                    self.after_end = False
                content.append(self.pending)
                self.pending = ""
            elif self.inside:
                if self.at_start:
                    stripped = self.pending.lstrip()
                    if START.startswith(stripped):
                        break  # maybe the model's own <think>: wait for more
                    if stripped.startswith(START):
                        self.pending = stripped[len(START) :]
                    self.at_start = False
                    continue
                j = self.pending.find(END)
                if j >= 0:
                    reasoning.append(self.pending[:j])
                    self.pending = self.pending[j + len(END) :]
                    self.inside, self.done, self.after_end = False, True, True
                    continue
                keep = partial_suffix(self.pending, (END,))
                reasoning.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            else:
                i = self.pending.find(START)
                if i >= 0:
                    content.append(self.pending[:i])
                    self.pending = self.pending[i + len(START) :]
                    self.inside, self.at_start = True, False
                    continue
                keep = partial_suffix(self.pending, (START,))
                content.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        return (rest, "") if self.inside else ("", rest)
