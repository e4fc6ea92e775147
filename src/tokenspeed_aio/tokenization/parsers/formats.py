"""The tool-call formats models emit: hermes / Qwen (``<tool_call>{json}</tool_call>``),
Llama 3 JSON (``{"name", "parameters"}``), Mistral (``[TOOL_CALLS][{...}]``), pythonic
(Llama 3.2/4: ``[f(a=1), g()]``), and vLLM's JSON array for servers with no parser.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tokenspeed_aio.tokenization.parsers.base import (
    Extraction,
    ParsedCall,
    ToolParser,
    arguments_text,
    const,
    json_call,
    repeated,
    schema_of,
    schema_part,
    sequence,
    structural_tag,
)

_DECODER = json.JSONDecoder()


def _json_values(text: str, separators: str = ";, \n") -> list[Any] | None:
    """Consecutive JSON values in ``text`` (separated by any of ``separators``); None when
    something else is in it."""
    values, i = [], 0
    while i < len(text):
        if text[i] in separators or text[i].isspace():
            i += 1
            continue
        try:
            value, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)
    return values


def _calls(objects: list[Any], args_key: str) -> list[ParsedCall] | None:
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
        calls.append(ParsedCall(obj["name"], arguments_text(args)))
    return calls


class HermesParser(ToolParser):
    """Hermes 2 Pro, Qwen 2.5/3: each call ``<tool_call>\\n{"name": ..., "arguments":
    {...}}\\n</tool_call>``, after any content."""

    name = "hermes"
    start_markers = ("<tool_call>",)
    closing_marker = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> Extraction:
        """A last block cut off before its closing tag (max_tokens) is dropped when it
        does not parse; any other block that does not parse makes the reply content."""
        start = text.find("<tool_call>")
        if start < 0:
            return Extraction(text, [])
        objects = []
        for block, closed in self._BLOCK.findall(text[start:]):
            values = _json_values(block.strip())
            if values is None or len(values) != 1:
                if not closed and objects:
                    break
                return Extraction(text, [])
            objects.append(values[0])
        return self.found(text, _calls(objects, "arguments"), text[:start].strip() or None)

    def call_format(self, tool: dict[str, Any]) -> dict[str, Any]:
        return json_call(tool, "arguments", begin="<tool_call>\n", end="\n</tool_call>")


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2 JSON: the reply is ``{"name": ..., "parameters": {...}}`` (calls
    separated by ``;``), optionally after ``<|python_tag|>``."""

    name = "llama3_json"
    start_markers = ("<|python_tag|>",)
    start_only = ("{",)

    def extract(self, text: str) -> Extraction:
        body = text.strip()
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return Extraction(text, [])
        values = _json_values(body)
        return self.found(text, None if values is None else _calls(values, "parameters"))

    def call_format(self, tool: dict[str, Any]) -> dict[str, Any]:
        return json_call(tool, "parameters")

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        return structural_tag(repeated(self.calls_of(tools), "; ", parallel))


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (v3) or
    ``name[ARGS]{...}`` per call (v11+). Call ids are 9 characters, as its templates
    require."""

    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)
    id_length = 9

    def new_id(self) -> str:
        return super().new_id()[len("call_") :]

    def extract(self, text: str) -> Extraction:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return Extraction(text, [])
        body = text[start + len("[TOOL_CALLS]") :].strip()
        calls: list[ParsedCall] | None
        if body.startswith("["):
            values = _json_values(body)
            flat = (
                values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
            )
            calls = None if flat is None else _calls(flat, "arguments")
        else:
            calls = []
            for part in body.split("[TOOL_CALLS]"):
                name, sep, args = part.partition("[ARGS]")
                values = _json_values(args.strip()) if sep else None
                if not name.strip() or not values or len(values) != 1:
                    calls = None
                    break
                calls.append(ParsedCall(name.strip(), arguments_text(values[0])))
        return self.found(text, calls, text[:start].strip() or None)

    def call_format(self, tool: dict[str, Any]) -> dict[str, Any]:
        return json_call(tool, "arguments")

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        fmt = repeated(self.calls_of(tools), ", ", parallel, begin="[TOOL_CALLS][", end="]")
        return structural_tag(fmt)


class PythonicParser(ToolParser):
    """Llama 3.2 / 4 pythonic: ``[get_weather(city="Paris"), f()]`` (keyword arguments,
    Python literals; JSON's true/false/null are read too)."""

    name = "pythonic"
    start_markers = ("<|python_start|>",)
    start_only = ("[",)
    _NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False,
              "None": None}  # fmt: skip

    def extract(self, text: str) -> Extraction:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        body = body.strip()
        if not body.startswith("["):
            return Extraction(text, [])
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return Extraction(text, [])
            calls = [self._call(node) for node in tree.elts]
        except (SyntaxError, ValueError):
            return Extraction(text, [])
        return self.found(text, calls)

    def _call(self, node: ast.expr) -> ParsedCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call with keyword arguments")
        args = {kw.arg: self._literal(kw.value) for kw in node.keywords if kw.arg}
        return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False))

    def _literal(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Name) and node.id in self._NAMES:
            return self._NAMES[node.id]
        if isinstance(node, ast.List | ast.Tuple):
            return [self._literal(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self._literal(k): self._literal(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)

    def call_format(self, tool: dict[str, Any]) -> dict[str, Any]:
        schema = schema_of(tool)
        props = schema.get("properties") or {}
        parts: list[dict[str, Any]] = [const(f"{tool['name']}(")]
        for i, (key, sub) in enumerate(props.items()):
            parts.append(const(f"{', ' if i else ''}{key}="))
            if sub.get("type") == "boolean":
                parts.append({"type": "regex", "pattern": "(True|False)"})
            else:
                parts.append(schema_part(sub))
        parts.append(const(")"))
        return sequence(*parts)

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        fmt = repeated(self.calls_of(tools), ", ", parallel, begin="[", end="]")
        return structural_tag(fmt)


class JsonArrayParser(ToolParser):
    """vLLM's format for ``required`` / named choices on a server with no parser: a JSON
    array of ``{"name", "parameters"}``."""

    name = "json"
    start_only = ("[",)

    def extract(self, text: str) -> Extraction:
        values = _json_values(text.strip())
        if not values or len(values) != 1 or not isinstance(values[0], list):
            return Extraction(text, [])
        return self.found(text, _calls(values[0], "parameters"))

    def call_format(self, tool: dict[str, Any]) -> dict[str, Any]:
        return json_call(tool, "parameters")

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        fmt = repeated(self.calls_of(tools), ", ", parallel, begin="[", end="]")
        return structural_tag(fmt)
