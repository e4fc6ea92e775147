"""Property-based scheduler tests: hypothesis drives random sequences of submissions,
client aborts and rounds (plan, dispatch to a model-free device, commit down to the
in-flight depth) against small KV pools, so capacity retraction and planned aborts
happen often. After every step:

* reference counts are never negative, each block's count equals the running
  requests holding it, and free + active == usable (no leak, no double free);
* the pool, max_num_seqs and the per-round token budget are never exceeded;
and over a whole run:
* every request ends exactly once (length, EOS, client abort or planned abort), and
  no token is accepted for a request after its end;
* every request that ran to its end produced exactly the reference tokens (the sim
  device reads its input back through the block table, so a bad table, prefix hit or
  reused page shows up as a wrong token); an aborted one produced a prefix of them;
* at the end, after draining, ``Scheduler.check_idle`` and ``BlockPool.check_idle``.
"""

from __future__ import annotations

from collections import Counter, deque

from helpers.sim_device import SimDevice, reference
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.block_pool import NULL_BLOCK
from tokenspeed_aio.scheduler.plan import ForwardCommitted, RequestFinished
from tokenspeed_aio.scheduler.request import Request, Status
from tokenspeed_aio.scheduler.scheduler import Scheduler, SchedulerConfig, SubmissionRejected

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


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24),
        page_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        caching=st.booleans(),
        depth=st.sampled_from([0, 1]),
        eos=st.booleans(),
    )
    def setup(self, num_blocks, page_size, max_num_seqs, budget, caching, depth, eos):
        self.config = SchedulerConfig(
            num_blocks=num_blocks,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=caching,
        )
        self.sched = Scheduler(self.config)
        self.device = SimDevice(num_blocks, page_size, max_num_seqs)
        self.depth = depth
        self.eos = EOS if eos else None
        self.inflight: deque = deque()
        self.prompts: dict[str, list[int]] = {}
        self.limits: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.ended: Counter = Counter()  # rid -> times it ended (must be exactly 1)
        self.how: dict[str, str] = {}  # rid -> length | eos | abort | planned_abort
        self.next_id = 0

    # -- rules ------------------------------------------------------------------
    @rule(prompt=prompt_strategy, max_tokens=st.integers(1, 20))
    def submit(self, prompt, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        max_output = min(max_tokens, MAX_MODEL_LEN - len(prompt))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        req = Request(rid, prompt, params, seed=0, max_output=max_output)
        fits = -(-len(prompt) // self.config.page_size) <= self.config.num_blocks - 1
        try:
            self.sched.submit([req])
        except SubmissionRejected:
            assert not fits, f"a prompt that fits the pool was refused: {len(prompt)}"
            return
        assert fits, "a prompt larger than the pool was accepted"
        self.prompts[rid], self.limits[rid], self.outputs[rid] = prompt, max_output, []

    def live(self) -> list[str]:
        return [rid for rid in self.prompts if not self.ended[rid]]

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.live()))
        self._end(rid, "abort")
        self.sched.advance_head([rid])  # as the loop's head applies a client abort

    @rule(rounds=st.integers(1, 4))
    def run_rounds(self, rounds):
        for _ in range(rounds):
            self._round()

    # -- one round, as EventLoop.round() runs it ----------------------------------
    def _round(self):
        plan = self.sched.next_execution_plan()
        for abort in plan.aborts:
            req = self.prompts[abort.rid]
            assert -(-(len(req) + self.limits[abort.rid]) // self.config.page_size) > (
                self.config.num_blocks - 1
            ), f"planned abort of a request that fits the pool alone: {abort}"
            self._end(abort.rid, "planned_abort")
            event("a planned abort")
        self._check_plan(plan)
        if plan.num_retracted:
            event("a capacity retraction")
        if any(row.new_owner and row.start for row in plan.rows):
            event("a prefix-cache hit or re-admission")
        events = []
        if plan.needs_device():
            self.inflight.append((plan, self.device.execute(plan)))
        depth = self.depth if plan.needs_device() else 0
        while len(self.inflight) > depth:
            events += self._commit(*self.inflight.popleft())
        self.sched.advance(events)

    def _commit(self, plan, result):
        accepted, finished = [], []
        for row, tok in zip(plan.sample_rows, result.tokens):
            if self.ended[row.rid]:
                accepted.append(None)  # ended while this forward was in flight: dropped
                continue
            accepted.append(tok)
            out = self.outputs[row.rid]
            out.append(tok)
            if tok == self.eos:
                self._end(row.rid, "eos")
                finished.append(RequestFinished(row.rid))
            elif len(out) >= self.limits[row.rid]:
                self._end(row.rid, "length")
                finished.append(RequestFinished(row.rid))
        return [ForwardCommitted(plan.plan_id, accepted), *finished]

    def _end(self, rid, how):
        self.ended[rid] += 1
        assert self.ended[rid] == 1, f"{rid} ended twice ({self.how[rid]}, then {how})"
        self.how[rid] = how

    def _check_plan(self, plan):
        assert plan.num_tokens <= self.config.max_num_batched_tokens
        slots = [row.slot for row in plan.rows]
        assert len(slots) == len(set(slots)) <= self.config.max_num_seqs
        for row in plan.rows:
            assert NULL_BLOCK not in row.new_block_ids, row
            assert not self.ended[row.rid], f"an ended request was scheduled: {row}"

    # -- invariants -------------------------------------------------------------
    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "sched"):
            return
        pool, sched = self.sched.pool, self.sched
        holders = Counter(b for req in sched.running for b in req.block_ids)
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
        if not hasattr(self, "sched"):
            return
        for _ in range(3000):
            if not self.sched.has_work():
                break
            self._round()
        assert not self.sched.has_work(), f"did not drain: {self.sched.requests}"
        self.sched.check_idle()
        self.sched.pool.check_idle()
        for rid, prompt in self.prompts.items():
            assert self.ended[rid] == 1, f"{rid} never ended"
            want = reference(prompt, self.limits[rid], self.eos)
            got = self.outputs[rid]
            if self.how[rid] in ("length", "eos"):
                assert got == want, (rid, self.how[rid], got, want)
            else:
                assert got == want[: len(got)], (rid, self.how[rid], got, want)


SchedulerMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
