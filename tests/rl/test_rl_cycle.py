"""An RL step end to end on CPU with a real trainer process: generate, pause, release the
weights and KV cache, the trainer changes the weights and sends them (a gloo broadcast,
a checkpoint on disk, tensors by torch multiprocessing handles), resume, continue,
generate -- the new outputs equal HF transformers' on the new weights."""

from __future__ import annotations

import pytest

from rl.harness import rl_step

SMALL = dict(max_model_len=512, page_size=4, num_kv_blocks=256, max_num_seqs=16)


@pytest.mark.parametrize("mode", ["distributed", "disk", "tensor"])
async def test_rl_step_on_one_rank(ckpt, start_engine, tmp_path, mode):
    source = ckpt("llama")
    engine = await start_engine(source, **SMALL)
    await rl_step(engine, source, tmp_path / "step-1", mode, num_ranks=1, version="step-1")
