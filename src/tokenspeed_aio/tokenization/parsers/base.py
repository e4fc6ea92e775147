"""What every tool-call parser is: how a model writes its calls (``extract``), where a
call may begin (``start_markers``), and the structural tag that makes a model write
well-formed calls for ``tool_choice`` "required" or a named function (``constraint``).

Tools are plain dicts here, ``{"name", "parameters"}``; the server turns OpenAI's shapes
into them. A parsed call's ``arguments`` is JSON text, as OpenAI returns it.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

_ALPHANUM = string.ascii_letters + string.digits


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default="")


@dataclass
class Extraction:
    content: str | None  # the text around the calls (None when there is none)
    calls: list[ParsedCall]


def call_id(length: int = 24) -> str:
    return "call_" + "".join(secrets.choice(_ALPHANUM) for _ in range(length))


def schema_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema (a tool without one takes an empty object)."""
    return tool.get("parameters") or {"type": "object", "properties": {}}


def arguments_text(value: Any) -> str:
    """A call's arguments as JSON text (models write an object; some write its text)."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except json.JSONDecodeError:
            return json.dumps(value)
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def const(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def schema_part(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema}


def sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def one_of(elements: list[dict[str, Any]]) -> dict[str, Any]:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def repeated(
    item: dict[str, Any], separator: str, parallel: bool, begin: str = "", end: str = ""
) -> dict[str, Any]:
    """``begin item (separator item)* end`` (just ``begin item end`` without parallel)."""
    parts = [const(begin)] if begin else []
    parts.append(item)
    if parallel:
        parts.append({"type": "star", "content": sequence(const(separator), item)})
    if end:
        parts.append(const(end))
    return sequence(*parts) if len(parts) > 1 else item


def json_call(tool: dict[str, Any], args_key: str, begin: str = "", end: str = "") -> dict:
    """``begin{"name": NAME, "<args_key>": <arguments per the tool's schema>}end``."""
    return sequence(
        const(f'{begin}{{"name": {json.dumps(tool["name"])}, "{args_key}": '),
        schema_part(schema_of(tool)),
        const("}" + end),
    )


def structural_tag(fmt: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


class ToolParser(ABC):
    """One model family's tool-call format."""

    name: str
    # Where a call begins: anywhere in the text, or (``start_only``) only at its start.
    start_markers: tuple[str, ...] = ()
    start_only: tuple[str, ...] = ()
    # Whether a call is complete before the text ends (hermes: at its closing tag).
    closing_marker: str | None = None
    id_length: int = 24

    @abstractmethod
    def extract(self, text: str) -> Extraction:
        """The calls in a complete reply; no calls (all content) when it holds none or
        they do not parse."""

    @abstractmethod
    def call_format(self, tool: dict[str, Any]) -> dict[str, Any]:
        """The structural-tag format of one call of ``tool``."""

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """The structural tag of a reply that is only calls of ``tools`` (at least one)."""
        return structural_tag(repeated(self.calls_of(tools), "\n", parallel))

    def calls_of(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        return one_of([self.call_format(tool) for tool in tools])

    def new_id(self) -> str:
        return call_id(self.id_length)

    def found(self, text: str, calls: list[ParsedCall] | None, content: str | None = None):
        """The extraction: ``calls`` (ids given) with ``content``, or, when no call parsed,
        the whole text as content."""
        if not calls:
            return Extraction(text, [])
        for call in calls:
            call.id = call.id or self.new_id()
        return Extraction(content, calls)
