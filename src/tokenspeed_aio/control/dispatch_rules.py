"""Every reason a dispatch cannot overlap a pending commit, in one place (Principle 4).

Correctness never depends on the in-flight depth: a dispatch whose inputs depend on
a pending commit's side effects commits the queue first. Prefer removing a
dependency over adding one here.
"""

from __future__ import annotations

from tokenspeed_aio.scheduler.plan import ExecutionPlan


def depends_on_pending_commit(plan: ExecutionPlan) -> bool:
    # An eager-grammar batch: its bitmask fill reads matchers only a commit advances.
    return plan.has_grammar
