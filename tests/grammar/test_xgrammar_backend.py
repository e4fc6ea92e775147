"""The xgrammar backend's own behaviour, without an engine."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from tokenspeed_aio.grammar.xgrammar_backend import json_grammar


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo([chr(i) for i in range(128)])  # one token per ASCII char
    return xgr.GrammarCompiler(info)


@pytest.mark.parametrize("bounds", [{}, {"maxLength": 8}, {"minLength": 1, "maxLength": 4}])
def test_json_strings_reject_raw_control_characters(compiler, bounds):
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", **bounds}}})
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(json_grammar(schema)))
    assert matcher.accept_string('{"s": "a')
    assert not matcher.accept_string("\x14")  # JSON forbids it unescaped
    assert matcher.accept_string('b"}')
