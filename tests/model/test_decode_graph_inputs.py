"""The decode graphs' packed inputs: what a replay ships in one copy, read back through the
views each captured graph reads (pure host logic; the graphs themselves are GPU-only)."""

import numpy as np
import pytest
import torch

from tokenspeed_aio.data_plane.cuda_graph import DecodeRows, pack_rows, staged_fields


def _rows(n: int) -> DecodeRows:
    rng = np.random.default_rng(n)
    return DecodeRows(
        positions=rng.integers(0, 2**40, n),  # past 32 bits: the int64 fields stay whole
        slot_mapping=rng.integers(0, 2**35, n),
        slots=rng.integers(0, 256, n),
        seq_lens=rng.integers(1, 8192, n).astype(np.int32),
        block_tables=rng.integers(1, 100, (n, 3)).astype(np.int32),
    )


@pytest.mark.parametrize("n, bs", [(1, 1), (3, 8), (13, 16), (0, 4), (255, 256)])
def test_each_graph_size_reads_the_rows_then_dummy_padding(n, bs):
    rows = _rows(n)
    staging = torch.full((1024 * 8,), 7, dtype=torch.int32)  # stale words from a larger size
    packed = pack_rows(bs, rows, dummy_slot=999)
    staging[: len(packed)] = torch.from_numpy(packed)
    positions, slot_mapping, slots, seq_lens = staged_fields(staging, bs)
    assert [t.dtype for t in (positions, slot_mapping, slots, seq_lens)] == [torch.int64] * 3 + [
        torch.int32
    ]
    pad = bs - n
    assert positions.tolist() == rows.positions.tolist() + [0] * pad
    assert slot_mapping.tolist() == rows.slot_mapping.tolist() + [-1] * pad  # writes nothing
    assert slots.tolist() == rows.slots.tolist() + [999] * pad  # the spare future token
    assert seq_lens.tolist() == rows.seq_lens.tolist() + [1] * pad  # one null-block key


def test_every_field_starts_16_byte_aligned():
    # Triton specializes kernels on pointer alignment: a field at an odd offset would compile
    # another variant of every kernel that reads it.
    for bs in (1, 2, 3, 8, 17, 256):
        staging = torch.zeros(4096, dtype=torch.int32)
        for field in staged_fields(staging, bs):
            assert (field.data_ptr() - staging.data_ptr()) % 16 == 0, bs
