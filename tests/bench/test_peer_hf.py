"""The HF peer on the tiny shape: both engines read the same safetensors, so their greedy
tokens must agree, and generate_batch must agree with plain generate()."""

from __future__ import annotations

import torch

from tokenspeed_aio.bench import peer_hf, suite, workloads
from tokenspeed_aio.bench.targets import EngineTarget


async def test_peer_generates_the_same_greedy_tokens_as_our_engine(
    tiny_dir, tiny_engine_args, tiny_tokens
):
    workload = workloads.fixed(
        tiny_tokens, input_len=12, output_len=10, concurrency=[4], num_requests=6
    )
    target = await EngineTarget.start(tiny_engine_args)
    try:
        results = await suite.run_target(target, workload, tiny_tokens)
    finally:
        await target.close()
    spec = suite.PeerSpec(str(tiny_dir), "float32", "cpu", random_init=False, max_batch_tokens=256)
    peers = suite.run_peer(spec, workload)
    ctx = suite.Context(target={"kind": "engine"}, machine={})
    run = suite.document(workload, ctx, results, peers, same_weights=True)["runs"][0]
    assert run["peer"]["completed"] == 6 and run["peer"]["output_tokens"] == 60
    assert run["peer_token_agreement"]["identical_requests"] == 6
    assert run["ours_over_peer"] > 0
    assert run["peer"]["tpot_ms"]["p50"] > 0


def test_generate_batch_greedy_matches_generate(tiny_dir, tiny_tokens):
    model = peer_hf.load_model(tiny_dir, "float32", "cpu", random_init=False)
    run = workloads.fixed(tiny_tokens, input_len=9, output_len=8, concurrency=[3]).runs[0]
    batch = peer_hf.run_peer(model, run, max_batch_tokens=128)["output_ids"]
    for conversation, got in zip(run.conversations, batch):
        ids = torch.tensor([conversation.turns[0].new_ids])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert got == ref[0, ids.shape[1] :].tolist()


def test_skipped_runs_say_why(tiny_tokens):
    timed = workloads.chat_mix(tiny_tokens, num_requests=3, rates=[1.0]).runs[0]
    assert "max_new_tokens" in peer_hf.skip_reason(timed)
    spec = suite.PeerSpec("unused", "float32", "cpu", random_init=False, max_batch_tokens=64)
    assert suite.run_peer(spec, workloads.Workload("x", [timed], {})) == [
        {"skipped": peer_hf.skip_reason(timed)}
    ]
