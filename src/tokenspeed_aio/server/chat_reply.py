"""A chat reply's parts: reasoning (``--reasoning-parser``), content, and tool calls
(the request's ToolPlan), for a whole reply or, streamed, delta by delta.

Reasoning is split first and tools are read from the content that remains. A reply
under a constraint (a tool choice's, a structured output's) starts outside any think
block: the grammar holds from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenspeed_aio.server.tool_choice import ToolPlan
from tokenspeed_aio.tokenization.parsers import (
    ParsedCall,
    ReasoningParser,
    ReasoningStream,
    ToolCallStream,
)


@dataclass
class ReplyParts:
    reasoning: str | None
    content: str | None
    calls: list[ParsedCall]


class ReplyParser:
    def __init__(
        self,
        plan: ToolPlan,
        reasoning: ReasoningParser | None,
        prompt_text: str,
        constrained: bool,
    ) -> None:
        self.plan = plan
        self.reasoning = reasoning
        self.prompt_text = prompt_text
        self.constrained = constrained

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.plan.parser is not None

    def whole(self, text: str) -> ReplyParts:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(self.prompt_text, text, self.constrained)
        if self.plan.parser is None or content is None:
            return ReplyParts(reasoning, content, [])
        if self.plan.named is not None:
            call = ParsedCall(self.plan.named, content.strip(), self.plan.parser.new_id())
            return ReplyParts(reasoning, None, [call])
        found = self.plan.parser.extract(content)
        return ReplyParts(reasoning, found.content if found.calls else content, found.calls)

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


class ReplyStream:
    """One choice's streamed reply: ``feed(delta)`` and, at its end, ``finish()``."""

    def __init__(self, parser: ReplyParser) -> None:
        self.parser = parser
        self.reasoning: ReasoningStream | None = (
            parser.reasoning.stream(parser.prompt_text, parser.constrained)
            if parser.reasoning
            else None
        )
        plan = parser.plan
        self.tools = ToolCallStream(plan.parser) if plan.parser and plan.named is None else None
        self.named_text: list[str] | None = [] if plan.named is not None else None
        self.calls = 0  # calls sent, their stream index

    def feed(self, delta: str) -> ReplyParts:
        reasoning, content = "", delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta)
        return self._tools(reasoning, content, final=False)

    def finish(self) -> ReplyParts:
        reasoning, content = "", ""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
        return self._tools(reasoning, content, final=True)

    def _tools(self, reasoning: str, content: str, final: bool) -> ReplyParts:
        calls: list[ParsedCall] = []
        if self.named_text is not None:
            self.named_text.append(content)
            content = ""
            if final:
                plan = self.parser.plan
                assert plan.parser is not None and plan.named is not None
                text = "".join(self.named_text).strip()
                calls = [ParsedCall(plan.named, text, plan.parser.new_id())]
        elif self.tools is not None:
            content, calls = self.tools.feed(content) if content else ("", [])
            if final:
                more_content, more = self.tools.finish()
                content, calls = content + more_content, calls + more
        self.calls += len(calls)
        return ReplyParts(reasoning or None, content or None, calls)
