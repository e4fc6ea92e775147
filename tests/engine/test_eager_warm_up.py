"""The startup warm-up compiles every form of the decode kernel an eager forward launches
(decode rows beside a prompt chunk, or alone where no captured graph holds the batch): with
the compile check at error a form first met while serving fails the engine. One row may
have tiles of its own, so 1 and the most rows alone leave the split launch of several
rows uncompiled."""

import pytest
import torch
from helpers.checkpoints import make_checkpoint
from tokenspeed_kernels.decode_attention import num_kv_splits_for, tiles_for

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.data_plane.device import build_device_side
from tokenspeed_aio.data_plane.runner import warm_up_rows
from tokenspeed_aio.data_plane.specs import RankInfo


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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_warm_up_forwards_run_and_write_no_cache(tmp_path, backend):
    """Every warm-up forward (decode rows alone and beside a chunk, up to the most rows)
    runs on the backend and stores nothing: its tokens' slots are -1."""
    make_checkpoint(tmp_path / "m")
    args = EngineArgs(
        model=str(tmp_path / "m"), device="cpu", page_size=4, num_kv_blocks=64, max_num_seqs=3,
        max_model_len=256, attention_backend=backend, kv_cache_dtype="fp8", kv_cache_scales="unit",
    )  # fmt: skip
    build = build_device_side(args, RankInfo())
    try:
        runner = build.handle._runner
        caches = [c.view(torch.uint8) for c in (*runner.k_caches, *runner.v_caches)]
        for c in caches:  # e4m3 1.0 everywhere: a store of anything (zeros too) shows
            c.fill_(0x38)
        runner.warm_up_eager(args.max_num_seqs)
        assert all(bool((c == 0x38).all()) for c in caches)
    finally:
        build.handle.shutdown()
