"""The startup warm-up compiles every form of the decode kernel an eager forward launches
(decode rows beside a prompt chunk, or alone where no captured graph holds the batch): with
the compile check at error a form first met while serving fails the engine (it did at c=64
when one-row launches got tiles of their own and the warm-up ran 1 and 512 rows only)."""

import pytest
from tokenspeed_kernels.decode_attention import num_kv_splits_for, tiles_for

from tokenspeed_aio.data_plane.runner import warm_up_rows


def _form(rows: int, itemsize: int, heads: int, max_seq_len: int, sms: int) -> tuple:
    """What decides the decode kernel's compiled variant for a given kind of forward (the
    new-token prologue is one per kind: ``triton_backend``): its tiles and whether it splits."""
    splits = num_kv_splits_for(rows, heads, max_seq_len, sms)
    return tiles_for(rows, itemsize, splits), splits == 1


@pytest.mark.parametrize("itemsize", [1, 2])
@pytest.mark.parametrize("heads", [1, 8, 32])
@pytest.mark.parametrize("max_seq_len", [256, 4096, 131072])
@pytest.mark.parametrize("max_decodes", [1, 2, 3, 64, 512])
def test_the_warm_up_rows_reach_every_form_of_the_decode_kernel(
    itemsize, heads, max_seq_len, max_decodes
):
    for sms in (78, 132):
        args = (itemsize, heads, max_seq_len, sms)
        served = {_form(n, *args) for n in range(1, max_decodes + 1)}
        warmed = {_form(n, *args) for n in warm_up_rows(max_decodes)}
        assert warmed == served, (args, max_decodes)


def test_the_warm_up_rows_stay_within_the_running_limit():
    assert warm_up_rows(1) == [1]
    assert warm_up_rows(2) == [1, 2]
    assert warm_up_rows(512) == [1, 2, 512]
