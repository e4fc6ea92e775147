"""``python -m tokenspeed_aio bench WORKLOAD [options]``: flags -> workload, target, report.

The target is an in-process AsyncEngine started from the ``serve`` flags (every
EngineArgs field; ``--shape`` writes a named checkpoint and points ``--model`` at
it), or a running server (``--server URL``; ``--model``/``--shape`` then only say
which model it serves, for the prompt vocabulary and the roofline).

Prompts depend only on ``--workload-seed``: a long-lived server still holds the
previous invocation's prompts in its prefix cache, so vary the seed between runs
against one (the report's cache-hit column shows any reuse).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from tokenspeed_aio.bench import report, suite, tier_compare
from tokenspeed_aio.bench.long_context import long_context_chat
from tokenspeed_aio.bench.output import OUT_HELP, default_out_path
from tokenspeed_aio.bench.shapes import SHAPES, checkpoint_dir
from tokenspeed_aio.bench.workloads import WORKLOADS, TokenSpace, parse_list

ALL_WORKLOADS = {**WORKLOADS, "long-context-chat": long_context_chat}

# Which workload flags each workload takes (the rest would be silently ignored).
WORKLOAD_FLAGS = {
    "fixed-1k": {"input_len", "output_len", "concurrency", "num_requests"},
    "latency": {"input_len", "output_len", "batch", "num_requests"},
    "overhead": {"input_len", "output_len", "concurrency"},
    "chat-mix": {"num_requests", "rates"},
    "agentic-prefix": {"conversations", "turns", "turn_tokens", "reply_tokens"},
    "long-context-chat": {
        "conversations",
        "turns",
        "context_tokens",
        "turn_tokens",
        "reply_tokens",
    },
}
ALL_WORKLOAD_FLAGS = sorted(set().union(*WORKLOAD_FLAGS.values()))


def build_parser() -> argparse.ArgumentParser:
    from tokenspeed_aio.engine_flags import add_engine_flags

    parser = argparse.ArgumentParser(
        prog="python -m tokenspeed_aio bench",
        description="Benchmark a workload; writes a JSON record and prints markdown tables.",
    )
    parser.add_argument("workload", choices=list(ALL_WORKLOADS))
    w = parser.add_argument_group("workload (defaults: the full size in docs/performance.md)")
    w.add_argument("--input-len", type=int, help="prompt tokens (fixed-1k, latency, overhead)")
    w.add_argument("--output-len", type=int, help="output tokens (fixed-1k, latency, overhead)")
    w.add_argument(
        "--concurrency", help='levels, e.g. "1,4,16,64,256" (fixed-1k) or "256" (overhead)'
    )
    w.add_argument(
        "--num-requests",
        help="fixed-1k: per level, one count or one per level, e.g. 3,128,512 (default "
        "max(4c, 256 if c>=64)); chat-mix, latency: total",
    )
    w.add_argument("--rates", help='chat-mix: arrival rates in req/s, e.g. "1,4,16,inf"')
    w.add_argument("--batch", type=int, help="latency: requests in flight at once")
    w.add_argument(
        "--conversations",
        type=int,
        help="agentic-prefix, long-context-chat: conversations (all at once)",
    )
    w.add_argument(
        "--context-tokens", type=int, help="long-context-chat: a conversation's first prompt"
    )
    w.add_argument(
        "--turns", type=int, help="agentic-prefix, long-context-chat: turns per conversation"
    )
    w.add_argument("--turn-tokens", type=int, help="agentic-prefix: new prompt tokens per turn")
    w.add_argument("--reply-tokens", type=int, help="agentic-prefix: reply tokens per turn")
    w.add_argument("--workload-seed", type=int, default=0, help="seed of prompts and lengths")
    t = parser.add_argument_group("target")
    t.add_argument("--shape", choices=list(SHAPES), help="write a named checkpoint and use it")
    t.add_argument("--shape-dir", type=Path, help="where shapes are written (default: tmp)")
    t.add_argument("--server", metavar="URL", help="drive a running server instead")
    t.add_argument("--api-key", help="the server's bearer key")
    t.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="the event loop")
    o = parser.add_argument_group("report")
    o.add_argument("--peer", choices=["hf"], help="also run HF generate_batch on the same runs")
    o.add_argument("--peer-device", help="device of the peer (default: the engine's)")
    o.add_argument(
        "--peer-levels", help='only these levels on the peer, e.g. "c=1,c=64" (default: all)'
    )
    o.add_argument("--no-roofline", action="store_true", help="skip the bandwidth measurement")
    o.add_argument("--no-warmup", action="store_true", help="no warm-up request before runs")
    o.add_argument("--out", type=Path, help=OUT_HELP)
    o.add_argument(
        "--kvstore-compare",
        metavar="RATIOS",
        help='run the workload once per --kvstore-ratio, e.g. "0,6" (the L2 tier off, then on)',
    )
    add_engine_flags(parser)
    return parser


def workload_kwargs(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The workload builder's keyword arguments from the flags the user gave."""
    allowed = WORKLOAD_FLAGS[ns.workload]
    kwargs: dict[str, Any] = {"seed": ns.workload_seed}
    for name in ALL_WORKLOAD_FLAGS:
        value = getattr(ns, name)
        if value is None:
            continue
        if name not in allowed:
            parser.error(f"--{name.replace('_', '-')} does not apply to {ns.workload}")
        if name == "rates":
            value = parse_list(value, float)
        elif name == "concurrency":
            value = parse_list(value)
        elif name == "num_requests":
            value = parse_list(value)
            value = value if ns.workload == "fixed-1k" and len(value) > 1 else value[0]
        kwargs[name] = value
    return kwargs


def _device(engine_device: str) -> str:
    import torch

    if engine_device != "auto":
        return engine_device
    return "cuda" if torch.cuda.is_available() else "cpu"


async def _measure(ns: argparse.Namespace, args, workload, tokens: TokenSpace):
    from tokenspeed_aio.bench.targets import EngineTarget, ServerTarget

    target = ServerTarget(ns.server, ns.api_key) if ns.server else await EngineTarget.start(args)
    try:
        return await suite.run_target(target, workload, tokens, warmup=not ns.no_warmup)
    finally:
        await target.close()


def _release_device_memory(device: str) -> None:
    """Hand cached device memory back, so what runs next sizes itself on a free device."""
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _run_loop(coro, kind: str):
    if kind == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def main(argv: list[str]) -> int:
    from tokenspeed_aio.engine_flags import engine_args_from
    from tokenspeed_aio.model.config import ModelConfig
    from tokenspeed_aio.model_source import resolve_model_path

    parser = build_parser()
    ns = parser.parse_args(argv)
    kwargs = workload_kwargs(ns, parser)
    if ns.shape and ns.model:
        parser.error("give --model or --shape, not both")
    if ns.workload == "overhead" and not (ns.shape or ns.model):
        ns.shape = "overhead"  # the workload is defined on this model
    try:
        args = engine_args_from(ns)
        model_dir = checkpoint_dir(ns.shape, ns.shape_dir, args.seed) if ns.shape else None
        model_dir = model_dir or resolve_model_path(args.model)
    except ValueError as err:
        parser.error(str(err))
    from tokenspeed_aio.bench import peer_hf
    from tokenspeed_aio.bench.roofline import ModelBytes, measure_bandwidth, resolve_dtype

    on_disk = peer_hf.has_weights(model_dir)
    args = args.replace(model=str(model_dir), load_format=args.load_format if on_disk else "dummy")
    tokens = TokenSpace.from_model_dir(model_dir, args.tokenizer)
    workload = ALL_WORKLOADS[ns.workload](tokens, **kwargs)
    config = ModelConfig.from_pretrained(model_dir)
    dtype = resolve_dtype(args.dtype, config)
    device = _device(args.device)
    ctx = suite.Context(
        target={
            "kind": "server" if ns.server else "engine",
            "url": ns.server,
            "shape": ns.shape,
            "model_dir": str(model_dir),
            "weights": "dummy" if args.load_format == "dummy" else "checkpoint",
            "dtype": dtype,
            "event_loop": ns.loop,
            "engine_args": None if ns.server else vars(args),
        },
        machine=report.machine_info(),
        model_bytes=ModelBytes.of(
            config,
            dtype,
            fp8_weights=config.quantization is not None or args.quantization is not None,
            fp8_kv=args.kv_cache_dtype != "auto",
        ),
        tp=args.tp,
    )
    if ns.kvstore_compare:
        if ns.server or ns.peer:
            parser.error("--kvstore-compare starts its own engines: no --server or --peer")
        ratios = parse_list(ns.kvstore_compare, float)
        doc = tier_compare.run(
            ratios,
            args,
            workload,
            tokens,
            ctx,
            lambda coro: _run_loop(coro, ns.loop),
            warmup=not ns.no_warmup,
        )
        path = report.write_json(doc, ns.out or default_out_path(workload.name))
        print(tier_compare.render_markdown(doc))
        print(f"raw JSON: {path}")
        runs = [r for s in doc["kvstore_compare"] for r in s["document"]["runs"]]
        return 1 if sum(r["metrics"]["failed"] for r in runs) else 0
    if not ns.no_roofline:
        # Measured before the engine starts: its memory sizing must see the device free.
        ctx.bandwidth = measure_bandwidth(device)
        _release_device_memory(device)
    results = _run_loop(_measure(ns, args, workload, tokens), ns.loop)
    peers = None
    if ns.peer:
        _release_device_memory(device)
        spec = suite.PeerSpec(
            str(model_dir), dtype, ns.peer_device or device, not on_disk, args.chunked_prefill_size
        )
        levels = set(parse_list(ns.peer_levels, str)) if ns.peer_levels else None
        peers = suite.run_peer(spec, workload, levels)
    same_weights = on_disk and args.load_format != "dummy"
    doc = suite.document(workload, ctx, results, peers, same_weights)
    path = report.write_json(doc, ns.out or default_out_path(workload.name))
    print(report.render_markdown(doc))
    print(f"raw JSON: {path}")
    failed = sum(r["metrics"]["failed"] for r in doc["runs"])
    return 1 if failed else 0
