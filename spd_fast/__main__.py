"""Command line: `spd-fast generate ...` (also `python -m spd_fast`)."""
from __future__ import annotations

import argparse
import json
import sys
import warnings


def _generate(args: argparse.Namespace) -> int:
    import spd_fast

    if args.prompt is not None and (args.user or args.system):
        raise spd_fast.SpdConfigError("pass either a raw prompt or --system/--user messages, not both")
    if args.prompt is not None:
        prompt = args.prompt
    elif args.user:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                 [{"role": "user", "content": u} for u in args.user]
    else:
        raise spd_fast.SpdConfigError("give a prompt: a positional string or --user 'message'")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if args.json else "default")
        eng = spd_fast.load(model=args.model, draft=args.draft, num_stages=args.num_stages, dtype=args.dtype,
                            max_len=args.max_len)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, method=args.method)
    if args.json:
        out = eng.generate(prompt, **kw)
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "metrics": out.metrics,
                          "draft": eng.draft_source}))
        return 0
    for chunk in eng.stream(prompt, **kw):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    m = eng.last_metrics
    line = f"\n-- {int(m['new_tokens'])} tokens, {m['tokens_per_second']:.1f} tok/s"
    if args.method == "spd":
        line += (f", acceptance {m['acceptance_rate']:.2f}, tokens/cycle {m['tokens_per_cycle']:.2f}, "
                 f"equivalent accept length {m['equivalent_accept_length']:.2f} (n={eng.num_stages}, "
                 f"draft {eng.draft_source})")
    print(line, file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spd-fast", description="Speculative Pipeline Decoding runtime")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text (streams verified tokens)")
    g.add_argument("prompt", nargs="?", help="raw text prompt (no chat template)")
    g.add_argument("--user", action="append", default=[], help="a user message (repeatable)")
    g.add_argument("--system", help="a system message")
    g.add_argument("--method", choices=["spd", "ar"], default="spd")
    g.add_argument("--num-stages", type=int, default=3)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--model", help="HF checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--draft", help="draft head directory, or 'random' (default: the shipped head)")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--max-len", type=int, default=2048)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.set_defaults(func=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    from .config import SpdConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpdConfigError as e:
        print(f"spd-fast: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
