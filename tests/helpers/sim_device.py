"""A model-free device for scheduler tests: KV pages hold token ids.

It executes each plan at dispatch time, exactly as the real data plane's FIFO does,
writing every input token into the paged "KV" through the slot's block table and
"sampling" a deterministic function of the whole sequence *read back through the
block table*. So a wrong block table, a bad prefix-cache hit or a page reused while
still needed produces a wrong token, which the tests compare with a direct reference.
"""

from __future__ import annotations

from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardResult


def next_token(seq: list[int], vocab: int = 97) -> int:
    return (seq[-1] * 31 + len(seq) * 7 + (seq[-2] if len(seq) > 1 else 3)) % vocab


def reference(prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    return out


class SimDevice:
    def __init__(self, num_blocks: int, page_size: int, num_slots: int) -> None:
        self.page = page_size
        self.kv: list[list[int | None]] = [[None] * page_size for _ in range(num_blocks)]
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        self.last_sampled = [None] * num_slots

    def execute(self, plan: ExecutionPlan) -> ForwardResult:
        tokens = []
        for row in plan.rows:
            table = self.tables[row.slot]
            del table[row.block_offset :]
            table.extend(row.new_block_ids)
            inputs = row.token_ids if row.token_ids is not None else [self.last_sampled[row.slot]]
            assert len(inputs) == row.num_tokens and None not in inputs, row
            for i, tok in enumerate(inputs):
                pos = row.start + i
                block = table[pos // self.page]
                assert block != 0, f"write to the null block: {row}"
                self.kv[block][pos % self.page] = tok
            if row.sample:
                seq = [self.kv[table[p // self.page]][p % self.page] for p in range(row.end)]
                assert None not in seq, f"read of an unwritten KV position: {row}"
                tok = next_token(seq)
                self.last_sampled[row.slot] = tok
                tokens.append(tok)
        return ForwardResult(plan_id=plan.plan_id, tokens=tokens, logprobs=None)
