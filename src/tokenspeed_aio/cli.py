"""``python -m tokenspeed_aio serve|bench``: the command line. Every EngineArgs field is
a flag (dashes for underscores, args.py), so the CLI and the Python API share one spelling."""

from __future__ import annotations

import argparse
import sys

from tokenspeed_aio.engine_flags import add_engine_flags, engine_args_from
from tokenspeed_aio.server.flags import add_server_flags


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, except where its help already says what it is."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokenspeed_aio")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="run a benchmark workload (see `bench --help`)", add_help=False)
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        formatter_class=_HelpFormatter,
    )
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    add_server_flags(serve)
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
        try:
            args = resolve_model(args)
        except ValueError as err:  # one line, no usage block: the flag parsed fine
            print(f"error: {err}", file=sys.stderr)
            return 2
    if ns.command == "serve":
        from tokenspeed_aio.server.serve import run_server

        return run_server(args, ns)
    return 2


def resolve_model(args):
    """``--model`` as a checkpoint directory (a hub id resolved through the HF cache), its
    config checked, so a bad one is one line naming the problem before anything starts."""
    from tokenspeed_aio.model.config import ModelConfig
    from tokenspeed_aio.model_source import check_model_dir, resolve_model_path

    path = resolve_model_path(args.model)
    check_model_dir(path, args.model)
    ModelConfig.from_pretrained(path)  # an unsupported architecture fails here, in one line
    names = args.served_model_names or [
        "tokenspeed-default" if args.model is None else _default_name(args.model, path)
    ]
    return args.replace(model=str(path), served_model_name=names if len(names) > 1 else names[0])


def _default_name(model: str, path) -> str:
    """The name clients use when none was given: a hub id as given, else the directory's."""
    from pathlib import Path

    return model if not Path(model).expanduser().is_dir() else path.name


if __name__ == "__main__":
    sys.exit(main())
