"""What a request's grammar is, as plain values (torch-free: the control plane keys
its queue and the compile cache by it)."""

from __future__ import annotations

from typing import NamedTuple

from tokenspeed_aio.sampling_params import SamplingParams


class GrammarSpec(NamedTuple):
    kind: str  # json_schema | json_object | regex | ebnf | structural_tag
    text: str  # the schema / pattern / grammar ("" for json_object)


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    if params.json_schema is not None:
        return GrammarSpec("json_schema", params.json_schema)
    if params.json_object:
        return GrammarSpec("json_object", "")
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.ebnf is not None:
        return GrammarSpec("ebnf", params.ebnf)
    if params.structural_tag is not None:
        return GrammarSpec("structural_tag", params.structural_tag)
    return None
