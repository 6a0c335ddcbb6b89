"""Progress reporting that stays quiet when stderr is not a terminal."""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def interactive() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def status(message: str, enabled: bool = True) -> Iterator[None]:
    show = enabled and interactive()
    t0 = time.perf_counter()
    if show:
        print(f"spd_fast: {message} ...", file=sys.stderr, flush=True)
    yield
    if show:
        print(f"spd_fast: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def bar(it: Iterable[T], desc: str, total: int | None = None, enabled: bool = True) -> Iterable[T]:
    if not (enabled and interactive()):
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, total=total, leave=False)
