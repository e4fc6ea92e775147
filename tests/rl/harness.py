"""The RL tests' trainer process and the checks every variant shares."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from helpers.generation import final_outputs
from helpers.prompts import parity_prompts
from helpers.reference import hf_greedy

from tokenspeed_aio.bench.ports import free_port
from tokenspeed_aio.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "tests" / "helpers" / "trainer.py"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = parity_prompts()[:5]  # 1 to 64 tokens
GROUP = "rl-test-group"


class Trainer:
    """A real trainer process (helpers/trainer.py), driven over its stdin and stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, out: Path) -> None:
        self.proc = proc
        self.out = out

    @classmethod
    async def start(cls, mode: str, source: Path, out: Path, **spec) -> Trainer:
        spec = dict(mode=mode, source=str(source), out=str(out), src_path=str(ROOT / "src"), **spec)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(TRAINER), json.dumps(spec),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return cls(proc, out)

    async def expect(self, word: str, timeout: float = 120) -> None:
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if not line:
                raise AssertionError(f"the trainer exited before saying {word!r}")
            if line.decode().strip() == word:
                return

    async def manifest(self) -> dict:
        """Once the trainer saved its new checkpoint: names, dtypes, shapes."""
        path = self.out / "manifest.json"
        for _ in range(1200):
            if path.exists():
                return json.loads(path.read_text())
            await asyncio.sleep(0.1)
        raise AssertionError("the trainer never finished its step")

    async def finish(self) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        return await asyncio.wait_for(self.proc.wait(), 60)


async def generate(engine) -> list:
    return await final_outputs(engine, PROMPTS, GREEDY)


def assert_matches(outs: list, checkpoint: Path) -> None:
    for ids, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(str(checkpoint), tuple(ids), GREEDY.max_tokens)[0]


async def rl_step(engine, source: Path, out: Path, mode: str, num_ranks: int, version: str):
    """One RL step against a running engine: generate, pause(wait), release(weights,
    kv_cache), the trainer steps, resume(weights), the update, resume(kv_cache),
    continue, generate. The outputs must be HF transformers' on the new weights."""
    assert_matches(await generate(engine), source)
    await engine.pause_generation("wait")
    await engine.release_memory_occupation(["weights", "kv_cache"])
    port = free_port()
    trainer = await Trainer.start(
        mode, source, out, port=port, world_size=1 + num_ranks, group=GROUP
    )
    manifest = await trainer.manifest()
    if mode == "distributed":
        await engine.init_weights_update_group("127.0.0.1", port, 1, 1 + num_ranks, GROUP, "gloo")
        await trainer.expect("ready")
    await engine.resume_memory_occupation(["weights"])
    if mode == "distributed":
        result = await engine.update_weights_from_distributed(
            manifest["names"], manifest["dtypes"], manifest["shapes"], GROUP, weight_version=version
        )
        await trainer.expect("sent")
        await engine.destroy_weights_update_group(GROUP)
    elif mode == "tensor":
        await trainer.expect("ready")
        payload = (out / "payload.bin").read_bytes()
        result = await engine.update_weights_from_tensor([payload], weight_version=version)
    else:
        result = await engine.update_weights_from_disk(str(out), weight_version=version)
    assert await trainer.finish() == 0
    assert result.ok and result.weight_version == version
    await engine.resume_memory_occupation(["kv_cache"])
    await engine.continue_generation()
    outs = await generate(engine)
    assert_matches(outs, out)
    assert all(o.weight_version == version for o in outs)
    assert engine.weight_version == version
    return outs
