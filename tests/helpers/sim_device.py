"""A model-free device for scheduler tests: KV pages hold token ids.

It executes each plan exactly as the real data plane's FIFO does, writing every input
token into the paged "KV" through the slot's block table and "sampling" a
deterministic function of the whole sequence *read back through the block table*. So
a wrong block table, a bad prefix-cache hit or a page reused while still needed
produces a wrong token, which the tests compare with a direct reference.

Like a real KV entry, which depends on every token before it (attention), each
position also stores a hash chain of its prefix as it was when written; the read-back
checks it. So a block reused under another prefix (a prefix hit keyed on a block's
tokens alone, a page handed to a new owner) fails even where its tokens match.
"""

from __future__ import annotations

from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardResult

_ROOT = 0  # the prefix chain before position 0


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


def _chain(prefix: int, tok: int) -> int:
    return hash((prefix, tok))


class SimDevice:
    def __init__(self, num_blocks: int, page_size: int, num_slots: int) -> None:
        self.page = page_size
        # kv[block][offset] = (token, chain of the tokens before it), None when unwritten
        self.kv: list[list[tuple[int, int] | None]] = [
            [None] * page_size for _ in range(num_blocks)
        ]
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        self.last_sampled = [None] * num_slots
        # What a new slot owner told the slot (penalties and seeded sampling read it):
        # its prompt and committed outputs, copied as the real data plane copies them.
        self.owners: list[tuple[list[int], list[int]] | None] = [None] * num_slots

    def _cell(self, table: list[int], pos: int, row) -> tuple[int, int]:
        cell = self.kv[table[pos // self.page]][pos % self.page]
        assert cell is not None, f"read of an unwritten KV position {pos}: {row}"
        return cell

    def execute(self, plan: ExecutionPlan) -> ForwardResult:
        tokens = []
        for row in plan.rows:
            if row.new_owner is not None:
                owner = row.new_owner
                self.owners[row.slot] = (
                    list(owner.prompt_token_ids),
                    list(owner.output_token_ids),
                )
            table = self.tables[row.slot]
            del table[row.block_offset :]
            table.extend(row.new_block_ids)
            inputs = row.token_ids if row.token_ids is not None else [self.last_sampled[row.slot]]
            assert len(inputs) == row.num_tokens and None not in inputs, row
            if row.start:
                tok, prefix = self._cell(table, row.start - 1, row)
                prefix = _chain(prefix, tok)
            else:
                prefix = _ROOT
            for i, tok in enumerate(inputs):
                pos = row.start + i
                block = table[pos // self.page]
                assert block != 0, f"write to the null block: {row}"
                self.kv[block][pos % self.page] = (tok, prefix)
                prefix = _chain(prefix, tok)
            if row.sample:
                seq, prefix = [], _ROOT
                for pos in range(row.end):
                    tok, written_under = self._cell(table, pos, row)
                    assert written_under == prefix, (
                        f"KV position {pos} was written under another prefix: {row}"
                    )
                    seq.append(tok)
                    prefix = _chain(prefix, tok)
                prompt, outputs = self.owners[row.slot]
                assert seq[: len(prompt) + len(outputs)] == prompt + outputs, (
                    f"the slot's owner was given other tokens than its KV holds: {row}"
                )
                assert row.output_index == row.end - len(prompt), row
                tok = next_token(seq)
                self.last_sampled[row.slot] = tok
                tokens.append(tok)
        return ForwardResult(plan_id=plan.plan_id, tokens=tokens, logprobs=None)
