"""A request's structured-output fields -> SamplingParams' grammar fields.

Every spelling clients use maps onto the one xgrammar path (at most one may be given):
OpenAI's ``response_format`` (json_object, json_schema; SGLang's regex and ebnf; vLLM's
choice and structural_tag), the extra fields ``json_schema``, ``regex``, ``ebnf``,
vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, and its
``structured_outputs`` object. A choice becomes a regex of its alternatives.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenspeed_aio.protocol.openai import SamplingFields
from tokenspeed_aio.server.errors import ApiError


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def choice_regex(choices: list[str], param: str) -> str:
    """A regex matching exactly one of ``choices``."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise _bad(param, "a non-empty list of non-empty strings")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as err:
            raise _bad(param, f"not valid JSON ({err})") from None
        return schema
    return json.dumps(schema)


def _tag_text(tag: dict[str, Any] | str, param: str) -> str:
    text = _schema_text(tag, param)
    value = json.loads(text)
    if not isinstance(value, dict) or "format" not in value:
        raise _bad(param, "a structural tag is {'type': 'structural_tag', 'format': {...}}")
    return text


def _from_response_format(fmt: dict[str, Any]) -> tuple[str, str] | None:
    kind = fmt.get("type", "text")
    param = "response_format"
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _bad(param, "json_schema needs {'json_schema': {'schema': {...}}}")
        return "json_schema", json.dumps(spec["schema"])
    if kind in ("regex", "ebnf"):
        value = fmt.get(kind) or fmt.get("pattern" if kind == "regex" else "grammar")
        if not isinstance(value, str) or not value:
            raise _bad(param, f"type {kind} needs a non-empty {kind!r} string")
        return kind, value
    if kind == "choice":
        return "regex", choice_regex(fmt.get("choice") or [], param)
    if kind == "structural_tag":
        return "structural_tag", _tag_text(fmt, param)
    raise _bad(
        param,
        "type must be text, json_object, json_schema, regex, ebnf, choice or structural_tag, "
        f"got {kind!r}",
    )


def structured_output(req: SamplingFields) -> dict[str, Any]:
    """SamplingParams' grammar fields (json_schema, json_object, regex, ebnf,
    structural_tag); ApiError(400) naming the fields when two are given."""
    given: list[tuple[str, str, str]] = []  # (request field, kind, text)
    if req.response_format is not None:
        found = _from_response_format(req.response_format)
        if found:
            given.append(("response_format", *found))
    if req.json_schema is not None:
        given.append(("json_schema", "json_schema", _schema_text(req.json_schema, "json_schema")))
    if req.guided_json is not None:
        given.append(("guided_json", "json_schema", _schema_text(req.guided_json, "guided_json")))
    for name, kind in (("regex", "regex"), ("guided_regex", "regex"), ("ebnf", "ebnf")):
        if getattr(req, name) is not None:
            given.append((name, kind, getattr(req, name)))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", "ebnf", req.guided_grammar))
    if req.guided_choice is not None:
        given.append(("guided_choice", "regex", choice_regex(req.guided_choice, "guided_choice")))
    so = req.structured_outputs
    if so is not None:
        param = "structured_outputs"
        if so.json is not None:
            given.append((f"{param}.json", "json_schema", _schema_text(so.json, param)))
        if so.regex is not None:
            given.append((f"{param}.regex", "regex", so.regex))
        if so.choice is not None:
            given.append((f"{param}.choice", "regex", choice_regex(so.choice, param)))
        if so.grammar is not None:
            given.append((f"{param}.grammar", "ebnf", so.grammar))
        if so.json_object:
            given.append((f"{param}.json_object", "json_object", ""))
        if so.structural_tag is not None:
            tag = _tag_text(so.structural_tag, param)
            given.append((f"{param}.structural_tag", "structural_tag", tag))
    if len(given) > 1:
        names = ", ".join(name for name, _, _ in given)
        raise ApiError(
            400, f"{given[1][0]}: give one structured-output field, got {names}", param=given[1][0]
        )
    if not given:
        return {}
    _, kind, text = given[0]
    return {"json_object": True} if kind == "json_object" else {kind: text}
