"""xgrammar behind the control plane's grammar queue: compilation on a thread pool,
off the round, with a compile cache keyed by the grammar's text; matchers that the
commit advances and the data plane reads to fill token bitmasks.

xgrammar imports torch, so this module lives outside control/: the rank hands the
control plane an instance; the control plane only calls its methods.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
from collections import OrderedDict
from pathlib import Path

from tokenspeed_aio.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)


class GrammarCompileError(ValueError):
    """The grammar does not compile; the message is the compiler's."""


class XGrammarBackend:
    def __init__(
        self,
        tokenizer_dir: str | Path,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        *,
        max_threads: int = 2,
        cache_size: int = 128,
    ) -> None:
        self._tokenizer_dir = str(tokenizer_dir)
        self._vocab_size = vocab_size
        self._stop_ids = list(stop_token_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_threads, thread_name_prefix="ts-grammar"
        )
        self._compiler = None  # built on first use: loading the tokenizer takes seconds
        self._compiler_lock = threading.Lock()
        # The most recently used grammars, compiled: clients may send endless distinct
        # schemas, so this is bounded (a matcher keeps its own grammar alive).
        self._cache: OrderedDict[GrammarSpec, concurrent.futures.Future] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """A future of the compiled grammar; one compilation per distinct grammar text
        while it stays among the ``cache_size`` most recently used."""
        fut = self._cache.get(spec)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._cache[spec] = self._pool.submit(self._compile, spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec)
        return fut

    def matcher(self, compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def _compile(self, spec: GrammarSpec):
        compiler = self._get_compiler()
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
                return compiler.compile_grammar(json_grammar(schema))
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(compact_structural_tag(spec.text))
            return compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError) as err:  # xgrammar's grammar errors
            raise GrammarCompileError(_compiler_message(err)) from None

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import transformers
                import xgrammar as xgr

                tokenizer = transformers.AutoTokenizer.from_pretrained(self._tokenizer_dir)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
                )
                # No compiler cache: it would keep every grammar ever compiled (it has
                # no count bound); the bounded cache above serves repeats.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# xgrammar writes a length-bounded JSON string's characters as [^"\\\r\n], which admits raw
# control characters (JSON forbids U+0000..U+001F unescaped); its unbounded strings use
# the right class. Patched in the grammar text until upstream fixes it.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def json_grammar(schema: str) -> str:
    """The EBNF of a JSON schema: compact (free whitespace would let a weak model pad
    forever), with JSON's string characters."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def compact_structural_tag(text: str) -> str:
    """A structural tag whose JSON-schema parts are compact JSON grammars (json_grammar),
    as every other schema here: xgrammar's own admit free whitespace, which a weak model
    can fill until max_tokens."""

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and node.get("style", "json") == "json":
                schema = node["json_schema"]
                schema = schema if isinstance(schema, dict) else {} if schema else {"not": {}}
                return {"type": "grammar", "grammar": json_grammar(json.dumps(schema))}
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    try:
        return json.dumps(walk(json.loads(text)))
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise GrammarCompileError(f"the structural tag is not valid: {err}") from None


_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def _compiler_message(err: RuntimeError) -> str:
    """The compiler's message without xgrammar's timestamp and C++ source location."""
    text = _PREFIX.sub("", str(err).strip())
    return text.splitlines()[0] if text else "the grammar could not be compiled"
