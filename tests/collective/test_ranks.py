"""The fixed rank groups of the engine's layout (pure)."""

from __future__ import annotations

import pytest

from tokenspeed_aio.collective import Ranks


def test_tp2_dp2_layout_rows_are_replicas_and_columns_span_them():
    layout = [Ranks.build(rank, 4, tp=2, dp=2) for rank in range(4)]
    assert [r.replica for r in layout] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r.dp_column for r in layout] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [r.replica_leader for r in layout] == [0, 0, 2, 2]
    assert [(r.dp_rank, r.tp_rank) for r in layout] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r.world == (0, 1, 2, 3) for r in layout)
    assert layout[3].replicas == ((0, 1), (2, 3))


def test_pure_tp_and_pure_dp_degenerate_to_single_groups():
    tp_only = Ranks.build(2, 4, tp=4, dp=1)
    assert (tp_only.replica, tp_only.dp_column, tp_only.replica_leader) == ((0, 1, 2, 3), (2,), 0)
    dp_only = Ranks.build(2, 4, tp=1, dp=4)
    assert (dp_only.replica, dp_only.dp_column, dp_only.replica_leader) == ((2,), (0, 1, 2, 3), 2)
    single = Ranks.build(0, 1, tp=1, dp=1)
    assert single.replica == single.dp_column == single.world == (0,)


@pytest.mark.parametrize(
    ("rank", "world", "tp", "dp", "message"),
    [
        (0, 4, 2, 1, "world_size 4 != tp 2 \\* dp 1"),
        (4, 4, 2, 2, "rank 4 is outside"),
        (0, 0, 0, 1, "at least 1"),
    ],
)
def test_inconsistent_layouts_are_refused(rank, world, tp, dp, message):
    with pytest.raises(ValueError, match=message):
        Ranks.build(rank, world, tp=tp, dp=dp)
