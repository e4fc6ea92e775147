"""``python -m tokenspeed_aio serve|bench``: the command line. Every EngineArgs field is
a flag (dashes for underscores, args.py), so the CLI and the Python API share one spelling."""

from __future__ import annotations

import argparse
import sys

from tokenspeed_aio.args import add_engine_flags, engine_args_from


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
