"""The grammar queue with a fake compiler: a constrained request waits while its grammar
compiles and is admitted once compiled (with a replica, once compiled on every member,
in the same round on all); a compile error or timeout fails it; an abort drops it. And
a constrained request through the real round: its batch commits the queue first, so
the matcher the data plane reads has accepted every earlier token."""

from __future__ import annotations

import asyncio
import concurrent.futures
import types

import pytest
from helpers.fake_group import FakeGroup
from helpers.sim_engine import SimEngine, expected

from tokenspeed_aio.control import grammar as grammar_module
from tokenspeed_aio.control.grammar import GrammarQueue
from tokenspeed_aio.grammar.spec import GrammarSpec
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.plan import ExecutionPlan
from tokenspeed_aio.scheduler.request import Request


class FakeBackend:
    """Compiles nothing: a test resolves each compile's future when it likes."""

    def __init__(self) -> None:
        self.compiles: dict[GrammarSpec, concurrent.futures.Future] = {}

    def compile(self, spec: GrammarSpec) -> concurrent.futures.Future:
        return self.compiles.setdefault(spec, concurrent.futures.Future())

    def matcher(self, compiled) -> FakeMatcher:
        return FakeMatcher(compiled)


class FakeMatcher:
    """Accepts any token; terminates after ``length`` of them (the compiled value)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.accepted: list[int] = []

    def accept_token(self, token: int) -> bool:
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def constrained(rid: str, pattern: str = "a+") -> Request:
    params = SamplingParams(max_tokens=8, temperature=0.0, regex=pattern)
    return Request(rid, [1, 2, 3], params, seed=0, max_output=8)


def compile_of(backend: FakeBackend, pattern: str = "a+") -> concurrent.futures.Future:
    return backend.compiles[GrammarSpec("regex", pattern)]


async def test_without_a_backend_constrained_requests_are_refused():
    queue = GrammarQueue(None, timeout=1.0)
    req = constrained("a")
    ((refused, message),) = queue.enqueue([req])
    assert refused is req and "structured output is disabled" in message
    assert len(queue) == 0


async def test_a_request_is_admitted_once_compiled_with_its_matcher():
    backend = FakeBackend()
    queue = GrammarQueue(backend, timeout=10.0)
    req = constrained("a")
    assert queue.enqueue([req]) == []
    assert await queue.admit() == ([], []) and len(queue) == 1  # still compiling
    compile_of(backend).set_result(3)
    ready, failed = await queue.admit()
    assert ready == [req] and failed == [] and len(queue) == 0
    assert isinstance(req.grammar, FakeMatcher) and req.grammar.length == 3


async def test_requests_are_admitted_as_they_compile_not_in_arrival_order():
    backend = FakeBackend()
    queue = GrammarQueue(backend, timeout=10.0)
    slow, fast = constrained("slow", "s+"), constrained("fast", "f+")
    queue.enqueue([slow, fast])
    compile_of(backend, "f+").set_result(1)
    assert await queue.admit() == ([fast], [])
    compile_of(backend, "s+").set_result(1)
    assert await queue.admit() == ([slow], [])


async def test_a_compile_error_fails_the_request_with_the_compilers_message():
    backend = FakeBackend()
    queue = GrammarQueue(backend, timeout=10.0)
    bad, good = constrained("bad", "(("), constrained("good")
    queue.enqueue([bad, good])
    compile_of(backend, "((").set_exception(ValueError("unbalanced parenthesis"))
    compile_of(backend).set_result(2)
    ready, failed = await queue.admit()
    assert ready == [good]
    assert failed == [(bad, "regex: unbalanced parenthesis")]
    assert bad.grammar is None and len(queue) == 0


async def test_a_compile_past_the_timeout_fails(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(grammar_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    backend = FakeBackend()
    queue = GrammarQueue(backend, timeout=2.0)
    req = constrained("a")
    queue.enqueue([req])
    now[0] = 102.0  # at the deadline: still waiting
    assert await queue.admit() == ([], [])
    now[0] = 102.5
    ((failed, message),) = (await queue.admit())[1]
    assert failed is req and "did not compile within 2 s" in message
    assert message.startswith("regex: ") and "--grammar-compile-timeout-secs" in message
    compile_of(backend).set_result(1)  # a late compile changes nothing
    assert await queue.admit() == ([], []) and len(queue) == 0


async def test_an_abort_while_compiling_drops_the_request():
    backend = FakeBackend()
    queue = GrammarQueue(backend, timeout=10.0)
    a, b = constrained("a", "a+"), constrained("b", "b+")
    queue.enqueue([a, b])
    queue.abort(["a", "not-queued"])
    assert len(queue) == 1
    compile_of(backend, "a+").set_result(1)
    compile_of(backend, "b+").set_result(1)
    assert await queue.admit() == ([b], [])


async def replica_admit(queues: list[GrammarQueue]) -> list:
    return await asyncio.gather(*(q.admit() for q in queues))


def replica_queues(size: int) -> tuple[list[FakeBackend], list[GrammarQueue]]:
    group = FakeGroup(size)
    backends = [FakeBackend() for _ in range(size)]
    queues = [GrammarQueue(b, 10.0, group.member(r)) for r, b in enumerate(backends)]
    for q in queues:
        q.enqueue([constrained("a")])  # every member admits the same request
    return backends, queues


async def test_with_a_replica_a_request_is_admitted_once_compiled_on_every_member():
    backends, queues = replica_queues(2)
    compile_of(backends[0]).set_result(1)
    assert await replica_admit(queues) == [([], []), ([], [])]  # member 1 still compiling
    compile_of(backends[1]).set_result(1)
    results = await replica_admit(queues)
    assert [[r.rid for r in ready] for ready, _ in results] == [["a"], ["a"]]


@pytest.mark.parametrize("failing", [0, 1])
async def test_with_a_replica_one_members_compile_error_fails_it_on_every_member(failing):
    backends, queues = replica_queues(2)
    compile_of(backends[failing]).set_exception(ValueError("too deep"))
    results = await replica_admit(queues)  # the other member is still compiling
    for ready, failed in results:
        assert ready == [] and [(r.rid, m) for r, m in failed] == [("a", "regex: too deep")]
    assert [len(q) for q in queues] == [0, 0]


@pytest.mark.parametrize("depth", [0, 1])
async def test_a_constrained_request_through_the_round(depth):
    backend = FakeBackend()
    seen = []

    def check(plan: ExecutionPlan) -> None:
        for row in plan.rows:
            if row.grammar is not None:
                # The data plane fills the mask from a matcher that has accepted every
                # earlier output: the dispatch committed the in-flight queue first.
                assert len(row.grammar.accepted) == row.output_index, row
                assert not engine.loop.in_flight
                seen.append(row.output_index)

    engine = SimEngine(depth=depth, grammar_backend=backend, on_execute=check)
    plain = engine.generate("plain", [4, 5, 6], max_tokens=12)
    ruled = engine.generate("ruled", [1, 2, 3], max_tokens=12, regex="a+")
    for _ in range(3):
        await engine.round()  # compiling: the plain request runs meanwhile
    assert ruled.outputs == [] and plain.tokens
    compile_of(backend).set_result(5)  # the matcher terminates after 5 tokens
    await engine.run()
    assert ruled.tokens == expected([1, 2, 3], 5)
    assert ruled.finish_reason == "stop" and ruled.final.stop_reason is None
    assert plain.tokens == expected([4, 5, 6], 12)
    # At depth 1 the round that commits the terminating token planned one more row for it
    # before that commit: dispatched with a terminated matcher (no mask), its token dropped.
    assert seen == list(range(5 + depth))
    await engine.shutdown()
