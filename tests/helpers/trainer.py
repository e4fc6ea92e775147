"""A trainer process for the RL tests: it "trains" (changes every weight of a checkpoint
with seeded noise), saves the new checkpoint (the reference loads it in transformers),
and hands the weights to the engine one of three ways:

    distributed  join the weight-update group as rank 0 (it hosts the store) and
                 broadcast every tensor in the manifest's order
    tensor       write one payload of torch multiprocessing handles (shared-memory files)
                 and stay alive until told the engine read it (a line on stdin)
    disk         nothing more: the engine reads the saved checkpoint

    python tests/helpers/trainer.py '{"mode": ..., "source": DIR, "out": DIR, ...}'

It writes ``manifest.json`` (names, dtypes, shapes) into ``out`` once the checkpoint is
saved, and prints ``ready`` / ``sent`` / ``done`` lines as it goes (``paused`` where
``pause_after`` tensors were sent, for a test to kill it there).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main(spec: dict) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(spec["source"]), Path(spec["out"])
    generator = torch.Generator().manual_seed(spec.get("seed", 1))
    named = []
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(path).items():  # the "training step": every weight moves
            named.append((name, tensor + torch.randn(tensor.shape, generator=generator) * 0.3))
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(named), str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    manifest = {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    mode = spec["mode"]
    if mode == "distributed":
        sys.path.insert(0, spec["src_path"])
        from tokenspeed_aio.data_plane.weight_group import init_weights_update_group

        group = init_weights_update_group(
            "127.0.0.1", spec["port"], 0, spec["world_size"], spec["group"], "gloo", 60
        )
        print("ready", flush=True)
        stop_after = spec.get("stop_after")  # a trainer that dies mid-broadcast
        pause_after = spec.get("pause_after")  # one that waits there to be killed
        for i, (_, tensor) in enumerate(named):
            if stop_after is not None and i == stop_after:
                print("dying", flush=True)
                import os

                os._exit(3)
            if pause_after is not None and i == pause_after:
                print("paused", flush=True)
                sys.stdin.readline()
            group.broadcast(tensor.contiguous())
        print("sent", flush=True)
    elif mode == "tensor":
        sys.path.insert(0, spec["src_path"])
        import torch.multiprocessing as mp

        from tokenspeed_aio.data_plane.tensor_payload import serialize_named_tensors

        mp.set_sharing_strategy("file_system")  # handles any process can open
        if spec.get("device") == "cuda":  # CUDA tensors travel as CUDA IPC handles
            named = [(name, t.cuda()) for name, t in named]
        payload = serialize_named_tensors(named, spec.get("format"))
        (out / "payload.bin").write_bytes(payload)
        print("ready", flush=True)
        sys.stdin.readline()  # keep the shared tensors alive until the engine read them
    print("done", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
