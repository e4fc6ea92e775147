"""``python -m tokenspeed_aio serve|bench``: the command line. Every EngineArgs field is
a flag (dashes for underscores), so the CLI and the Python API share one spelling."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing

from tokenspeed_aio.args import EngineArgs

ENGINE_HELP = {
    "model": "local Hugging Face checkpoint directory (default: the built-in toy model)",
    "tokenizer": "tokenizer directory (default: the model directory)",
    "served_model_name": "the model name clients use (default: the model directory's name)",
    "dtype": "weights and activations dtype: auto (the checkpoint's), float32, bfloat16, float16",
    "load_format": "auto/safetensors: read the checkpoint's weights; dummy: random weights",
    "device": "auto (cuda when available), cpu or cuda",
    "seed": "seed of dummy weights",
    "tp": "tensor-parallel ranks per replica",
    "dp": "attention data-parallel replicas",
    "nnodes": "machines the engine's ranks span",
    "node_rank": "this machine's index (node 0 runs the HTTP frontend)",
    "dist_init_addr": "HOST:PORT on node 0 that every node reaches (needed when nnodes > 1)",
    "page_size": "tokens per KV-cache block (a power of two)",
    "max_model_len": "context length (default: the model's max_position_embeddings)",
    "max_num_seqs": "most requests running at once",
    "chunked_prefill_size": "token budget of one scheduling round (long prompts are chunked)",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "in_flight_depth": "forwards dispatched ahead of their commit (0: none, 1: overlap)",
    "num_kv_blocks": "fix the KV pool size in blocks (default: sized from memory)",
    "kv_cache_memory_gb": "CPU: memory for the KV cache, GiB",
    "gpu_memory_utilization": "GPU: fraction of device memory the engine may use",
    "attention_backend": "auto (triton on CUDA, torch on CPU), torch, triton, or flashinfer "
    "(needs the flashinfer-python package, 16-bit dtypes)",
    "enforce_eager": "GPU: no CUDA graphs",
    "max_cudagraph_capture_size": "GPU: largest decode batch captured in a CUDA graph",
    "cudagraph_capture_sizes": "GPU: exact decode batch sizes to capture",
    "chat_template": "a jinja chat template, or a file holding one (default: the tokenizer's)",
    "grammar_backend": "structured output (json_schema, regex, ebnf): xgrammar or none",
    "grammar_compile_timeout_secs": "a grammar not compiled within this fails its request",
}


def _flag_type(field: dataclasses.Field):
    hint = typing.get_type_hints(EngineArgs)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) and args:
        hint = args[0]
    return hint


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineArgs):
        name = "--" + field.name.replace("_", "-")
        kind = _flag_type(field)
        help_text = ENGINE_HELP[field.name]
        if kind is bool:
            group.add_argument(
                name, action=argparse.BooleanOptionalAction, default=field.default, help=help_text
            )
        elif typing.get_origin(kind) is list:
            group.add_argument(name, type=int, nargs="+", default=None, help=help_text)
        else:
            group.add_argument(name, type=kind, default=field.default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if getattr(ns, "model_pos", None):
        values["model"] = ns.model_pos
    return EngineArgs(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokenspeed_aio")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="run a benchmark workload (see `bench --help`)", add_help=False)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument(
        "--api-key", default=None, help="require this bearer key on every route but /health"
    )
    server.add_argument(
        "--max-body-bytes", type=int, default=8 * 2**20, help="largest request body accepted"
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging verbosity",
    )
    add_engine_flags(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the bench subcommand owns its flags
        from tokenspeed_aio.bench import bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        args = engine_args_from(ns)
    except ValueError as err:
        parser.error(str(err))
    if ns.command == "serve":
        from tokenspeed_aio.server.serve import run_server

        return run_server(args, ns)
    return 2


if __name__ == "__main__":
    sys.exit(main())
