"""The multi-turn long-context workload: each conversation opens with a long context (a
document and a question) and then goes on for several short turns, every turn resending
the whole conversation so far; all conversations run at once.

Its working set (every conversation's context) is meant to exceed the device KV pool
(``--num-kv-blocks`` at a fraction of it): between two turns of one conversation the
others evict its prefix from the device, and the next turn either recomputes it or, with
the L2 host tier on, loads it back.
"""

from __future__ import annotations

from tokenspeed_aio.bench.workloads import Conversation, Run, TokenSpace, Turn, Workload


def long_context_chat(
    tokens: TokenSpace,
    *,
    conversations: int = 16,
    turns: int = 4,
    context_tokens: int = 8192,
    turn_tokens: int = 256,
    reply_tokens: int = 128,
    seed: int = 0,
) -> Workload:
    sample = tokens.sampler(seed)
    built = [
        Conversation(
            [Turn(sample(context_tokens), reply_tokens)]
            + [Turn(sample(turn_tokens), reply_tokens) for _ in range(turns - 1)]
        )
        for _ in range(conversations)
    ]
    final = context_tokens + (turns - 1) * turn_tokens + turns * reply_tokens
    params = {
        "conversations": conversations,
        "turns": turns,
        "working_set_tokens": conversations * final,
    }
    runs = [Run(f"conversations={conversations}", built, None, params)]
    settings = dict(
        conversations=conversations,
        turns=turns,
        context_tokens=context_tokens,
        turn_tokens=turn_tokens,
        reply_tokens=reply_tokens,
        working_set_tokens=conversations * final,
        seed=seed,
    )
    return Workload("long-context-chat", runs, settings)
