"""`spd-fast serve`: the OpenAI-compatible HTTP server of spd_fast.server over one loaded engine."""
from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

from .cli_common import add_model_options, apply_runtime_options, kv_length, load_engine, non_negative_int, positive_int
from .config import SpdConfigError


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions)",
                       description="Serve /v1/completions, /v1/chat/completions and /v1/models over one engine, "
                       "one request decoding at a time (SPD is a single-sequence method). Stop with Ctrl-C.")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--port", type=non_negative_int, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    s.add_argument("--num-stages", "-n", type=positive_int, default=None,
                   help="pipeline stages n (default: the --draft head's own n, else 3)")
    s.add_argument("--method", choices=["spd", "ar"], default="spd",
                   help="spd (default) or ar, the plain autoregressive baseline")
    s.add_argument("--served-model-name", help="the model name the API reports and accepts (default: the model "
                   "file's or directory's name)")
    s.add_argument("--max-len", type=kv_length, default=2048, help="KV cache length: prompt + new tokens + n + 1 "
                   "(default: 2048)")
    s.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    add_model_options(s)
    s.set_defaults(func=run)


STOP_WAIT_S = 10.0  # seconds Ctrl-C waits for the request that is decoding to end at its next piece


def _listen_error(args: argparse.Namespace, e: OSError) -> SpdConfigError:
    from .server import bind_hint

    return SpdConfigError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); {bind_hint(e)}")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .server import make_server

    if args.port > 65535:
        raise SpdConfigError(f"--port must be 0..65535, got {args.port}")
    try:  # a taken port or a wrong host fails now, not after the model has loaded
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        socket.create_server((args.host, args.port), family=family).close()
    except OSError as e:
        raise _listen_error(args, e) from None
    apply_runtime_options(args)
    eng = load_engine(args, args.num_stages, quiet=False, draft="random" if args.method == "ar" and
                      args.draft is None else None)
    name = args.served_model_name or (Path(args.model).name if args.model else "SmolLM2-135M-Instruct")
    try:
        httpd = make_server(eng, name, args.host, args.port, args.method, quiet=args.quiet)
    except OSError as e:
        raise _listen_error(args, e) from None
    host, port = httpd.server_address[:2]
    host = f"[{host}]" if ":" in host else host
    print(f"spd-fast: serving {name!r} (method {args.method}, n={eng.num_stages}, draft {eng.draft_source}) on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        # Ctrl-C while a request decodes: end it at its next piece, and wait for its thread to leave torch (an
        # interpreter that exits under a daemon thread inside torch's C++ aborts: SIGABRT, not status 130)
        if not httpd.spd.stop(timeout=STOP_WAIT_S):
            print(f"spd-fast: a request still held the engine after {STOP_WAIT_S:g} s; exiting without it",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(130)
    return 0
