"""Property-based tests of the round: hypothesis drives random sequences of
submissions, client aborts and rounds of the real EventLoop (Scheduler, Ingress,
OutputProcessor over a LocalTransport) on the model-free SimDataPlane, against small
KV pools, so capacity retraction and planned aborts happen often. After every step:

* reference counts are never negative, each block's count equals the running
  requests holding it, and free + active == usable (no leak, no double free);
* the pool, max_num_seqs and the per-round token budget are never exceeded, and no
  dispatched row belongs to a request that already ended;
and over a whole run:
* every request gets exactly one final output and nothing after it (length, EOS,
  client abort, planned abort, or a refused submission batch);
* every request that ran to its end produced exactly the reference tokens (the sim
  device reads its input back through the block table, so a bad table, prefix hit or
  reused page shows up as a wrong token); an aborted one produced a prefix of them;
* a submission batch is refused (400) exactly when one of its prompts exceeds the
  pool, and a request is aborted by the plan (503) only when it cannot fit alone;
* at the end, after the loop's own drain, ``EventLoop.check_idle`` (scheduler, block
  pool, output processor, in-flight queue).

Half the machines run with the L2 host tier (either write policy, small host and snapshot
pools, cache ops landing up to two rounds late): retraction images, restores, load-backs
and write-backs happen too, a block is also held by a request being restored and by a
write-through still copying it, and the leak check covers both tiers and the open ops.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from helpers.sim_engine import SimEngine, expected
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenspeed_aio.scheduler.block_pool import NULL_BLOCK
from tokenspeed_aio.scheduler.cache_ops import WRITE_POLICIES
from tokenspeed_aio.scheduler.plan import ExecutionPlan
from tokenspeed_aio.scheduler.request import Status
from tokenspeed_aio.scheduler.scheduler import HostTierConfig

EOS = 5
MAX_MODEL_LEN = 48
# Prompts share prefixes often (so prefix-cache hits, shared blocks and evictions
# happen): a few bases, cut and extended at random.
BASES = [[(7 * b + 3 * i) % 97 for i in range(40)] for b in range(3)]
prompt_strategy = st.builds(
    lambda base, cut, tail: (BASES[base][:cut] + tail)[: MAX_MODEL_LEN - 1] or [1],
    st.integers(0, len(BASES) - 1),
    st.integers(0, 40),
    st.lists(st.integers(0, 96), max_size=8),
)


class RoundMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24),
        page_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        caching=st.booleans(),
        depth=st.sampled_from([0, 1]),
        eos=st.booleans(),
        host=st.one_of(
            st.none(),
            st.tuples(
                st.integers(1, 32),  # host blocks
                st.integers(0, 6),  # snapshot pages
                st.integers(0, 3),  # snapshot states
                st.sampled_from(WRITE_POLICIES),
                st.integers(0, 2),  # ACK delay in rounds
            ),
        ),
    )
    def setup(self, num_blocks, page_size, max_num_seqs, budget, caching, depth, eos, host):
        self.aio = asyncio.new_event_loop()
        self.engine = SimEngine(
            depth=depth,
            eos_token_ids=[EOS] if eos else [],
            on_execute=self._check_plan,
            host=None if host is None else HostTierConfig(*host[:4]),
            ack_delay=0 if host is None else host[4],
            num_blocks=num_blocks,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=caching,
        )
        self.config = self.engine.config
        self.stops = [EOS] if eos else []
        self.prompts: dict[str, list[int]] = {}
        self.limits: dict[str, int] = {}
        self.batch_of: dict[str, int] = {}  # rid -> the round its submission arrived in
        self.arrival_aborted: set[str] = set()
        self.rounds = 0
        self.retractions = 0

    def fits(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.config.page_size) <= self.config.num_blocks - 1

    # -- rules ------------------------------------------------------------------
    @rule(prompt=prompt_strategy, max_tokens=st.integers(1, 20))
    def submit(self, prompt, max_tokens):
        rid = f"r{len(self.prompts)}"
        self.engine.generate(rid, prompt, max_tokens)
        self.prompts[rid] = prompt
        self.limits[rid] = min(max_tokens, MAX_MODEL_LEN - len(prompt))
        self.batch_of[rid] = self.rounds

    def live(self) -> list[str]:
        return [rid for rid in self.prompts if not self.engine.stream(rid).finished]

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.live()))
        if self.batch_of[rid] == self.rounds:
            self.arrival_aborted.add(rid)  # never submitted: it leaves its batch
        self.engine.abort(rid)

    @rule(rounds=st.integers(1, 4))
    def run_rounds(self, rounds):
        for _ in range(rounds):
            self._round()

    def _round(self):
        if not self.engine.busy():
            return  # an idle round only waits (a heartbeat) for messages
        self.aio.run_until_complete(self.engine.round())
        self.rounds += 1
        if self.engine.scheduler.num_retractions > self.retractions:
            self.retractions = self.engine.scheduler.num_retractions
            event("a capacity retraction")

    # -- checks -------------------------------------------------------------------
    def _check_plan(self, plan: ExecutionPlan) -> None:
        """Each plan as it is dispatched."""
        assert plan.num_tokens <= self.config.max_num_batched_tokens
        slots = [row.slot for row in plan.rows]
        assert len(slots) == len(set(slots)) <= self.config.max_num_seqs
        for row in plan.rows:
            assert NULL_BLOCK not in row.new_block_ids, row
            assert self.engine.loop.output.owns(row.rid), f"an ended request was scheduled: {row}"
        if any(row.new_owner and row.start for row in plan.rows):
            event("a prefix-cache hit or re-admission")
        for op in plan.cache.ops() if plan.cache is not None else ():
            event(f"a {op.kind} op")

    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "engine"):
            return
        sched = self.engine.scheduler
        pool = sched.pool
        holders = Counter(b for req in sched.running for b in req.block_ids)
        # Blocks a restore in flight writes (its request may have ended meanwhile) ...
        restoring = [r for r in sched.requests.values() if r.image is not None and r.block_ids]
        holders.update(b for req in restoring for b in req.block_ids)
        tier = sched.host_tier
        if tier is not None:  # ... and the sources a write-through still copies (pinned)
            for op, _, _ in tier._open.values():
                if op.kind == "write_back" and not op.stream_ordered:
                    holders.update(op.src_blocks)
        for block in range(pool.num_blocks):
            assert pool.ref_count(block) >= 0
            assert pool.ref_count(block) == holders[block], (block, pool.ref_count(block))
        assert pool.num_free + pool.num_active == pool.num_usable
        assert pool.num_active <= pool.num_usable
        assert len(sched.running) <= self.config.max_num_seqs
        assert len({req.slot for req in sched.running}) == len(sched.running)
        for req in sched.waiting:
            assert req.status is Status.WAITING and not req.block_ids

    # -- the end: drain, then everything is released and every output is right ------
    def teardown(self):
        if not hasattr(self, "engine"):
            return
        try:
            self.aio.run_until_complete(self.engine.run(max_rounds=3000))
            self.aio.run_until_complete(self.engine.shutdown())  # every stream final
        finally:
            self.aio.close()
        batches: dict[int, list[str]] = {}
        for rid, k in self.batch_of.items():
            if rid not in self.arrival_aborted:
                batches.setdefault(k, []).append(rid)
        for rid, prompt in self.prompts.items():
            (stream,) = self.engine.streams[rid]
            final = stream.final
            refused = not all(
                self.fits(len(self.prompts[r])) for r in batches.get(self.batch_of[rid], [])
            )
            if rid in self.arrival_aborted:
                assert (final.finish_reason, stream.tokens) == ("abort", []), rid
                continue
            assert (final.error_status == 400) == refused, (rid, final)
            if final.error_status == 503:
                assert not self.fits(len(prompt) + self.limits[rid]), (
                    f"planned abort of a request that fits the pool alone: {final}"
                )
                event("a planned abort")
            want = expected(prompt, self.limits[rid], self.stops)
            if final.finish_reason in ("length", "stop"):
                assert stream.tokens == want, (rid, final.finish_reason, stream.tokens, want)
            else:
                assert stream.tokens == want[: len(stream.tokens)], (rid, final, want)


RoundMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_round_state_machine = RoundMachine.TestCase
