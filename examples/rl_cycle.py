"""The RL cycle a verl/slime-style trainer drives against a running tokenspeed_aio server,
over plain HTTP (SGLang's routes), with this script as the trainer:

    rollout    POST /generate
    pause      POST /pause_generation {"mode": "wait"}
    release    POST /release_memory_occupation {"tags": ["weights", "kv_cache"]}
    train      (here: every weight of the checkpoint moves by seeded noise)
    resume     POST /resume_memory_occupation {"tags": ["weights"]}
    update     POST /init_weights_update_group + /update_weights_from_distributed (this
               process broadcasts the tensors, gloo), or /update_weights_from_disk
    resume     POST /resume_memory_occupation {"tags": ["kv_cache"]}
    continue   POST /continue_generation
    rollout    POST /generate: meta_info.weight_version is the new one

    python -m tokenspeed_aio serve /path/to/ckpt --port 8000 &
    python examples/rl_cycle.py --url http://127.0.0.1:8000 --checkpoint /path/to/ckpt

The trainer's side of the weight group is ``tokenspeed_aio.data_plane.weight_group``
(any process can run it: it needs torch, not the engine). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def call(url: str, route: str, body: dict | None = None, method: str = "POST") -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + route, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        raise SystemExit(f"{route}: HTTP {err.code}: {err.read().decode()}") from None


def rollout(url: str, prompts: list[list[int]]) -> list[dict]:
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    return call(url, "/generate", {"input_ids": prompts, "sampling_params": params})


def train_step(checkpoint: Path, seed: int):
    """The stand-in for a trainer's step: the checkpoint's tensors, each moved by noise."""
    import torch
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(seed)
    named = []
    for path in sorted(checkpoint.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            named.append((name, (tensor.float() + 0.3 * noise).to(tensor.dtype)))
    return named


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def update_by_broadcast(url: str, named: list, version: str, engine_ranks: int) -> dict:
    from tokenspeed_aio.data_plane.weight_group import init_weights_update_group

    port, group_name = free_port(), "rl-cycle"
    answers: dict[str, dict] = {}

    def post(route: str, body: dict) -> None:
        answers[route] = call(url, route, body)

    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 1 + engine_ranks,
        "group_name": group_name,
        "backend": "gloo",
    }
    joining = threading.Thread(target=post, args=("/init_weights_update_group", init))
    joining.start()  # the engine's ranks join while this process hosts the group
    group = init_weights_update_group("127.0.0.1", port, 0, 1 + engine_ranks, group_name, "gloo")
    joining.join()
    update = {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "group_name": group_name,
        "weight_version": version,
    }
    receiving = threading.Thread(target=post, args=("/update_weights_from_distributed", update))
    receiving.start()
    for _, tensor in named:
        group.broadcast(tensor.contiguous())
    receiving.join()
    call(url, "/destroy_weights_update_group", {"group_name": group_name})
    return answers["/update_weights_from_distributed"]


def update_from_disk(url: str, named: list, version: str) -> dict:
    from safetensors.torch import save_file

    out = Path(tempfile.mkdtemp(prefix="rl-cycle-"))
    save_file(dict(named), str(out / "model.safetensors"))
    return call(
        url, "/update_weights_from_disk", {"model_path": str(out), "weight_version": version}
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--checkpoint", required=True, type=Path, help="the served weights")
    parser.add_argument("--mode", choices=["distributed", "disk"], default="distributed")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--engine-ranks", type=int, default=1, help="tp * dp of the server")
    args = parser.parse_args()
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23]]
    before = rollout(args.url, prompts)
    print(f"rollout: weight version {before[0]['meta_info']['weight_version']}", flush=True)
    for step in range(1, args.steps + 1):
        version = f"step-{step}"
        timings = {}
        for name, route, body in (
            ("pause", "/pause_generation", {"mode": "wait"}),
            ("release", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
        ):
            start = time.perf_counter()
            call(args.url, route, body)
            timings[name] = time.perf_counter() - start
        named = train_step(args.checkpoint, seed=step)
        start = time.perf_counter()
        call(args.url, "/resume_memory_occupation", {"tags": ["weights"]})
        timings["resume weights"] = time.perf_counter() - start
        start = time.perf_counter()
        if args.mode == "distributed":
            answer = update_by_broadcast(args.url, named, version, args.engine_ranks)
        else:
            answer = update_from_disk(args.url, named, version)
        timings["update"] = time.perf_counter() - start
        assert answer["success"] and answer["weight_version"] == version, answer
        for name, route, body in (
            ("resume kv_cache", "/resume_memory_occupation", {"tags": ["kv_cache"]}),
            ("continue", "/continue_generation", {}),
        ):
            start = time.perf_counter()
            call(args.url, route, body)
            timings[name] = time.perf_counter() - start
        after = rollout(args.url, prompts)
        served = {r["meta_info"]["weight_version"] for r in after}
        assert served == {version}, served
        assert call(args.url, "/get_weight_version", method="GET")["weight_version"] == version
        changed = sum(a["output_ids"] != b["output_ids"] for a, b in zip(after, before))
        steps = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items())
        print(f"step {step}: {version} served, {changed}/{len(prompts)} rollouts changed; {steps}")
        before = after
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
