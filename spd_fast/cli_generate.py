"""`spd-fast generate`: stream verified text, then one summary line (or one JSON object with --json)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .cli_common import (DefaultsFormatter, add_model_options, apply_runtime_options, kv_length, load_engine,
                         non_negative_int, positive_int)


def add_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text (streams verified tokens, then a summary line)",
                       description="Generate with SPD (or the AR baseline). Text streams to stdout as it is "
                       "verified; the summary line goes to stderr.", formatter_class=DefaultsFormatter)
    g.add_argument("prompt", nargs="?", help="raw text prompt (no chat template); - reads it from standard input")
    g.add_argument("--user", action="append", default=[], help="a user message (repeatable; chat template)")
    g.add_argument("--system", help="a system message (with --user)")
    g.add_argument("--method", choices=["spd", "ar"], default="spd",
                   help="spd (default) or ar, the plain autoregressive baseline")
    g.add_argument("--num-stages", "-n", type=positive_int, default=None,
                   help="pipeline stages n (default: the --draft head's own n, else 3)")
    g.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, help="sampling seed")
    g.add_argument("--max-len", type=kv_length, default=2048, help="KV cache length: prompt + new tokens + n + 1")
    g.add_argument("--eos-id", type=non_negative_int, action="append", default=[],
                   help="an extra stop token id besides the model's own (repeatable)")
    g.add_argument("--stop", action="append", default=[],
                   help="a stop string: the answer ends before its first occurrence (repeatable)")
    add_model_options(g)
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, metrics) "
                   "instead of streaming")
    g.set_defaults(func=run)


def _prompt(args: argparse.Namespace) -> Any:
    from .config import SpdConfigError

    # an empty --system is a system message (it replaces the chat template's default one), not no message
    if args.prompt is not None and (args.user or args.system is not None):
        raise SpdConfigError("pass either a raw prompt or --system/--user messages, not both")
    if args.prompt == "-":  # `echo ... | spd-fast generate -`, as llama.cpp and shells do
        if sys.stdin is None:
            raise SpdConfigError("the prompt - reads standard input, which is closed; pipe the prompt in")
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpdConfigError(f"standard input is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                                 "convert it (e.g. iconv -t UTF-8) before piping it in") from None
        text = text[:-1] if text.endswith("\n") else text  # the newline echo adds is not part of the prompt
        if not text:
            raise SpdConfigError("standard input was empty; pipe a non-empty prompt in")
        return text
    if args.prompt is not None:
        return args.prompt
    if args.user:
        return ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
               [{"role": "user", "content": u} for u in args.user]
    if args.system is not None:
        raise SpdConfigError("--system needs at least one --user message")
    raise SpdConfigError("give a prompt: a positional string or --user 'message' (chat template)")


def summary_line(m: dict[str, float], method: str, num_stages: int, draft: str, finish_reason: str) -> str:
    speed = (f"{m['tokens_per_second']:.1f} tok/s decode" if m["new_tokens"] > 1
             else "no decode step (the one token came from the prefill)")  # not "0.0 tok/s"
    line = f"-- {int(m['new_tokens'])} tokens (finish_reason={finish_reason}), {speed}"
    if method == "spd" and not m["verifications"]:  # the answer ended before any draft was verified
        line += f", no draft verified (n={num_stages}, draft {draft})"
    elif method == "spd":
        line += (f", acceptance {m['acceptance_rate']:.2f}, tokens/cycle {m['tokens_per_cycle']:.2f}, "
                 f"equivalent accept length {m['equivalent_accept_length']:.2f} (n={num_stages}, draft {draft})")
    else:
        line += " (AR baseline)"
    return line


def run(args: argparse.Namespace) -> int:
    from .api import check_stop
    from .sampling import SamplingParams

    prompt = _prompt(args)
    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # fail before loading the model
    check_stop(args.stop)
    apply_runtime_options(args)
    # AR needs no draft head: a random one avoids a misleading "no shipped head" warning
    draft = "random" if args.method == "ar" and args.draft is None else None
    eng = load_engine(args, args.num_stages, quiet=args.json, draft=draft)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, method=args.method, eos_ids=args.eos_id, stop=args.stop or None)
    if args.json:
        out = eng.generate(prompt, **kw)
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "prompt_tokens": out.prompt_tokens,
                          "finished_by_eos": out.finished_by_eos, "finish_reason": out.finish_reason,
                          "method": args.method,
                          "num_stages": eng.num_stages if args.method == "spd" else 1,
                          "draft": eng.draft_source if args.method == "spd" else None,
                          "model": str(eng.target.path), "metrics": out.metrics}))
        return 0
    if hasattr(sys.stdout, "reconfigure"):  # a terminal or file in another encoding (Latin-1, cp1252) shows what it
        sys.stdout.reconfigure(errors="replace")  # cannot encode as "?" instead of stopping mid-answer
    for chunk in eng.stream(prompt, **kw):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary_line(eng.last_metrics, args.method, eng.num_stages, eng.draft_source, eng.last_finish_reason),
          file=sys.stderr)
    return 0
