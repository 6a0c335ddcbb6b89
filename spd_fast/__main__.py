"""Command line: `spd-fast {generate,bench,eval,serve,train,info} ...` (also `python -m spd_fast`).

Each subcommand lives in a `cli_*.py` module; `train` forwards its arguments untouched to
`python -m spd_fast.train`. Errors a user can fix exit with status 2 and one line naming the
problem and the fix (argparse does the same for malformed arguments).
"""
from __future__ import annotations

import argparse
import os
import sys

_TRAIN_HELP = "train a draft head (PDM): self-distil, then train; `spd-fast train --help` for its options"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, cli_bench, cli_generate, cli_info, cli_serve
    from .cli_common import Parser

    p = Parser(prog="spd-fast", description="Speculative Pipeline Decoding runtime. "
                                "Run `spd-fast <command> --help` for a command's options.")
    p.add_argument("--version", action="version", version=f"spd_fast {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{generate,bench,eval,serve,train,distributed,info}")
    cli_generate.add_parser(sub)
    cli_bench.add_parsers(sub)
    cli_serve.add_parser(sub)
    # listed for --help; main() hands `train ...` to spd_fast.train before argparse sees it
    sub.add_parser("train", help=_TRAIN_HELP, add_help=False)
    sub.add_parser("distributed", add_help=False,
                   help="SPD with one stage per torchrun rank; `spd-fast distributed --help` for its options")
    cli_info.add_parser(sub)
    return p


def _train(argv: list[str]) -> int:
    from .train.__main__ import main as train_main

    return train_main(argv, help_command="spd-fast train")


def main(argv: list[str] | None = None) -> int:
    from .config import SpdConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "train":
            return _train(argv[1:])
        if argv and argv[0] == "distributed":  # torchrun ... -m spd_fast distributed ...
            from .distributed.__main__ import main as distributed_main

            return distributed_main(argv[1:])
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the subcommand, whose --help lists its options (the top level's does not)
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        if sys.stdout is None and args.command in ("generate", "bench", "eval", "info"):  # `spd-fast ... >&-`
            raise SpdConfigError("standard output is closed; run it with an output (a terminal, a pipe or > FILE)")
        try:
            return args.func(args)
        except SpdConfigError as e:
            from .cli_common import cli_message

            raise SpdConfigError(cli_message(e, parser, args.command)) from None
    except SpdConfigError as e:
        print(f"spd-fast: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spd-fast: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `spd-fast ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # a path the file system refuses (too long, unreadable, a device): one line, no traceback
        where = f" ({e.filename})" if e.filename else ""
        print(f"spd-fast: error: {e.strerror or e}{where}; check the path and its permissions", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
