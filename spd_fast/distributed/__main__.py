"""`torchrun --nproc-per-node N -m spd_fast.distributed [options]`: SPD with one stage per rank.

Every rank runs this same command; rank 0 prints the output. Exit status: 0 done, 2 a configuration
problem (same message on every rank), 1 another rank failed or timed out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    from ..cli_common import (DefaultsFormatter, Parser, add_lookup_option, kv_length, layer_list, non_negative_int,
                              positive_int)

    p = Parser(prog="python -m spd_fast.distributed",
               description="Speculative pipeline decoding with one stage per torch.distributed rank. Launch with "
               "torchrun (one process per stage); rank 0 prints the output.", formatter_class=DefaultsFormatter)
    p.add_argument("prompt", nargs="?", help="raw text prompt (no chat template)")
    p.add_argument("--user", action="append", default=[], help="a user message (chat template; repeatable)")
    p.add_argument("--system", help="a system message")
    p.add_argument("--requests", help="JSON file: a list of {prompt | prompt_ids, max_new_tokens, temperature, "
                   "top_k, top_p, seed, eos_ids} (runs them in order)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int)
    p.add_argument("--eos-id", type=int, action="append", default=[], help="an extra stop token id (repeatable)")
    p.add_argument("--model", help="HF checkpoint directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="draft head directory or 'random' (default: the shipped head, else random)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="decoder layers of a random head (default 1); a trained head brings its own")
    # --draft-vocab as in spd_fast.train; --draft-vocab-size, its first spelling, still works
    p.add_argument("--draft-vocab", "--draft-vocab-size", dest="draft_vocab_size", type=non_negative_int, default=0,
                   metavar="SIZE", help="draft vocabulary of a random head (default 0: the full vocabulary)")
    p.add_argument("--seed-head", type=int, default=None, help="seed of a random head (default 0)")
    p.add_argument("--num-stages", type=positive_int,
                   help="must equal the number of processes (default: the world size)")
    p.add_argument("--boundaries", type=layer_list, help="stage boundaries, e.g. 0,12,30 (uneven splits allowed)")
    p.add_argument("--anchors", type=layer_list,
                   help="PDM anchor layers of a random head, e.g. 0,10,20,29 (default: boundaries)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per local rank)")
    p.add_argument("--max-len", type=kv_length, default=2048, help="KV cache length: prompt + new tokens + n + 1")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a rank waits for a message before declaring its peer lost (default 30)")
    p.add_argument("--startup-timeout", type=float, default=60.0,
                   help="the same for joining and loading (default 60)")
    p.add_argument("--threads", type=non_negative_int, default=0,
                   help="torch CPU threads per rank (default: torch's choice)")
    add_lookup_option(p)
    p.add_argument("--json", action="store_true", help="print a JSON document instead of the text")
    p.add_argument("--output", help="also write the JSON results to this file (rank 0)")
    return p


REQUEST_KEYS = ("prompt", "prompt_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "eos_ids")


def check_prompt_args(args: argparse.Namespace) -> None:
    """Exactly one prompt source; every rank checks this before loading, so none waits for a doomed job."""
    from ..config import SpdConfigError

    chat = bool(args.user or args.system)
    if args.requests and (args.prompt is not None or chat):
        raise SpdConfigError("--requests FILE holds the prompts; drop the positional prompt and --system/--user, "
                             "or drop --requests")
    if args.prompt is not None and chat:
        raise SpdConfigError("pass either a raw prompt or --system/--user messages, not both")
    if args.system and not args.user and not args.requests:
        raise SpdConfigError("--system needs at least one --user message")
    if args.prompt is None and not args.user and not args.requests:
        raise SpdConfigError("give a prompt: a positional string, --user 'message' or --requests FILE")


def _requests(args: argparse.Namespace, target: Any) -> list:
    from ..config import SpdConfigError
    from ..sampling import SamplingParams
    from .engine import Request

    if args.requests:
        try:
            with open(args.requests) as f:
                items = json.load(f)
        except (OSError, ValueError) as e:
            raise SpdConfigError(f"cannot read --requests {args.requests}: {e}") from None
        if not isinstance(items, list) or not items or not all(isinstance(it, dict) for it in items):
            raise SpdConfigError(f"--requests {args.requests} must hold a non-empty JSON list of objects, e.g. "
                                 '[{"prompt": "Hi", "max_new_tokens": 32}]')
    else:
        check_prompt_args(args)
        if args.prompt is not None:
            prompt: Any = args.prompt
        else:
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                     [{"role": "user", "content": u} for u in args.user]
        items = [{"prompt": prompt}]
    reqs = []
    for it in items:
        unknown = sorted(set(it) - set(REQUEST_KEYS))
        if unknown:  # a misspelt key would silently fall back to the command-line default
            raise SpdConfigError(f"request {len(reqs)} has unknown keys {unknown}; a request may hold "
                                 f"{', '.join(REQUEST_KEYS)}")
        if "prompt_ids" not in it and "prompt" not in it:
            raise SpdConfigError(f"request {len(reqs)} has neither 'prompt' nor 'prompt_ids'")
        if "prompt_ids" in it and "prompt" in it:
            raise SpdConfigError(f"request {len(reqs)} has both 'prompt' and 'prompt_ids'; keep one of them")
        ids = it["prompt_ids"] if "prompt_ids" in it else target.encode(it["prompt"])
        params = SamplingParams(it.get("temperature", args.temperature), it.get("top_k", args.top_k),
                                it.get("top_p", args.top_p), it.get("seed", args.seed))
        extra_eos = it.get("eos_ids", args.eos_id)
        if not isinstance(ids, list) or not isinstance(extra_eos, list):
            raise SpdConfigError(f"request {len(reqs)}: prompt_ids and eos_ids must be lists of token ids")
        # ids, eos ids and max_new_tokens are checked (not coerced) with every request in run_requests
        reqs.append(Request(tuple(ids), it.get("max_new_tokens", args.max_new_tokens), params,
                            tuple(target.eos_ids) + tuple(extra_eos)))
    return reqs


def run(args: argparse.Namespace) -> int:
    import torch

    from ..cli_common import check_output, print_warnings
    from ..config import SpdConfigError
    from .engine import load_distributed
    from .launch import shutdown

    check_prompt_args(args)

    def check_rank0_output() -> None:  # only rank 0 writes it (other hosts may lack that folder)
        if os.environ.get("RANK", "0") == "0":
            check_output(args.output, "--output")

    if args.threads:
        torch.set_num_threads(args.threads)
    with warnings.catch_warnings(record=True) as caught:  # e.g. "no shipped head": one line, as in the other CLIs
        warnings.simplefilter("always")
        eng = load_distributed(model=args.model, draft=args.draft, num_stages=args.num_stages,
                               boundaries=args.boundaries, anchors=args.anchors,
                               draft_layers=args.draft_layers, dtype=args.dtype, device=args.device,
                               max_len=args.max_len, seed=args.seed_head or 0, progress=not args.json,
                               timeout=args.timeout, startup_timeout=args.startup_timeout,
                               draft_vocab_size=args.draft_vocab_size, lookup=args.lookup,
                               startup_check=check_rank0_output)  # every rank hears of a bad --output at once
    if not args.json:
        print_warnings(caught)
    if not eng.is_driver:
        eng.run_requests([])
        shutdown()
        return 0
    try:
        if args.seed_head is not None and eng.draft_source != "random":
            raise SpdConfigError(f"--seed-head seeds a random head, but this run uses {eng.draft_source}; drop "
                                 "--seed-head, or pass --draft random")
        reqs = _requests(args, eng.target)
    except Exception:
        eng.driver.end_call()
        raise
    outs = eng.run_requests(reqs)
    doc = {"num_stages": eng.num_stages, "boundaries": list(eng.boundaries), "draft": eng.draft_source,
           "rank_stats": {str(r): v for r, v in eng.last_rank_stats.items()},
           "results": [{"text": o.text, "token_ids": o.token_ids, "finished_by_eos": o.finished_by_eos,
                         "finish_reason": o.finish_reason,
                        "metrics": o.metrics} for o in outs]}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=1)
    if args.json:
        print(json.dumps(doc))
    else:
        for o in outs:
            print(o.text)
            m = o.metrics
            print(f"-- {int(m['new_tokens'])} tokens, {m['tokens_per_second']:.1f} tok/s, acceptance "
                  f"{m['acceptance_rate']:.2f}, tokens/cycle {m['tokens_per_cycle']:.2f} (n={eng.num_stages}, "
                  f"draft {eng.draft_source})", file=sys.stderr)
    shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..config import SpdConfigError
    from .comm import RankFailure

    args = build_parser().parse_args(argv)
    who = f" (rank {os.environ['RANK']})" if os.environ.get("RANK") else ""
    try:
        return run(args)
    except SpdConfigError as e:
        from ..cli_common import cli_message

        code, msg = 2, cli_message(e, build_parser())
    except RankFailure as e:
        code, msg = 1, str(e)
    print(f"spd_fast.distributed: error{who}: {msg}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)  # skip the process-group teardown: a dead peer could make it hang


if __name__ == "__main__":
    sys.exit(main())
