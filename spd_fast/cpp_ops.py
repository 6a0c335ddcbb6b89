"""The C++ CPU ops (spd_fast/csrc/spd_ops.cpp), built just in time on first use and cached.

`available()` builds once per process (a cached build loads in well under a second); without a
compiler, or when the build fails, it warns once and returns False, and `spd_fast.kernels` falls
back to the PyTorch twins. Build cache: $TORCH_EXTENSIONS_DIR/spd_fast, else `cpp` under spd_fast's cache
($SPD_FAST_CACHE, default ~/.cache/spd_fast), one subdirectory per CPU kind (machine and instruction-set flags).

Concurrent builders (several ranks starting at once) queue on an flock in the build directory.
torch's own build lock is a plain file that a killed builder leaves behind, after which every later
`load()` waits forever; the flock dies with its holder, so whoever holds it knows that any torch
lock file still there is stale, and removes it.
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "spd_ops.cpp"
SOURCES = (SOURCE, CSRC / "gguf_linear.cpp")
OPS = ("aggregate_cpp", "verify_greedy_cpp", "verify_sampling_cpp", "draft_sample_cpp", "q4_1_linear", "q8_0_linear")
BUILD_WAIT_S = 900.0  # how long to queue behind another process's build before giving up
_state: dict[str, object] = {}


def build_dir() -> Path:
    """One build per CPU kind: the ops are compiled with -march=native, so a build made on an AVX-512 host
    would die of an illegal instruction on an AVX2 host sharing the same home directory or image."""
    from .store import cache_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")  # torch's own setting for where extensions build comes first
    base = Path(root) / "spd_fast" if root else cache_root() / "cpp"
    return base / f"{_cpu_key()}-{_source_key()}"


CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]


def _source_key() -> str:
    """The sources' bytes and directory, the compiler flags and the torch version: ninja rebuilds by mtime and
    does not track torch's headers, so a source put back with an older mtime, or a torch upgraded in place, would
    keep an old library; a new key builds in a new directory instead."""
    import hashlib

    # and where the sources lie: torch's build file names them by absolute path, so two checkouts (a CI clone and
    # a working tree) sharing one directory rebuilt it for each other, a minute or more inside another's load
    h = hashlib.sha256(" ".join(CFLAGS + [torch.__version__, str(CSRC)]).encode())
    for src in SOURCES:
        h.update(src.read_bytes() if src.is_file() else b"missing")
    return h.hexdigest()[:10]


def _cpu_key(cpuinfo: str = "/proc/cpuinfo") -> str:
    import hashlib
    import platform

    flags = ""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()}-{hashlib.sha256(flags.encode()).hexdigest()[:10]}"


def _build() -> None:
    from torch.utils.cpp_extension import load

    for src in SOURCES:
        if not src.is_file():
            raise FileNotFoundError(f"{src} is missing (the C++ sources ship inside the package: reinstall spd_fast)")
    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    with _build_lock(d):
        stale = d / "lock"  # torch's FileBaton, left by a builder that died
        if stale.exists():
            # the flock dies with its process, but a builder killed alone leaves its ninja and compilers running in d
            # (they do not hold our lock): let them finish before a second ninja writes the same files
            _wait_for_orphans(d, BUILD_WAIT_S)
            stale.unlink(missing_ok=True)
        # (CFLAGS: -fno-trapping-math lets GCC vectorise the masked exp loops; the ops never read FP exceptions)
        load(name="spd_fast_cpp", sources=[str(s) for s in SOURCES], build_directory=str(d), is_python_module=False,
             extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
             verbose=False)
    _register_fakes()


def _processes_in(d: Path) -> list[int]:
    """Other processes whose working directory is d (torch runs ninja there); [] where /proc cannot say."""
    target, out = str(d.resolve()), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for e in entries:
        if e.isdigit() and int(e) != os.getpid():
            try:
                if os.readlink(f"/proc/{e}/cwd") == target:
                    out.append(int(e))
            except OSError:  # gone, or not ours to read
                pass
    return out


def _wait_for_orphans(d: Path, timeout: float) -> None:
    """Wait until no process works in d (an earlier builder's orphaned ninja), polling for `timeout` seconds."""
    end = time.monotonic() + timeout
    while pids := _processes_in(d):
        if time.monotonic() > end:
            raise TimeoutError(f"processes {pids} still work in the C++ build directory {d} after {timeout:g} s "
                               "(an interrupted build's compilers?); stop them or delete that directory and retry")
        time.sleep(0.5)


def _first_cause(text: str) -> str:
    """The line of a failed build that says why: a compiler's error or a missing program, rather than
    torch's "Error building extension" or ninja's "build stopped"."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()] or [""]
    for want in (lambda s: "error:" in s.lower() or "not found" in s or "No such file" in s,
                 lambda s: "error" in s.lower() and "build" not in s.lower()):
        hit = next((ln for ln in lines if want(ln) and not ln.startswith(("FAILED:", "["))), None)
        if hit is not None:
            return hit
    return lines[-1]


@contextlib.contextmanager
def _build_lock(d: Path):
    """Exclusive flock on d/.spd_fast_build.lock, polled for BUILD_WAIT_S (no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock is all there is
        yield
        return
    with open(d / ".spd_fast_build.lock", "a+") as fh:
        end = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise TimeoutError(
                        f"another process has held the C++ build lock in {d} for over {BUILD_WAIT_S:g} s; "
                        "if no spd_fast build is running, delete that directory and retry") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _register_fakes() -> None:
    """Shapes for FakeTensor / torch.compile tracing, so the C++ ops stay opaque in a graph."""
    def rows_out(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = logits.shape[:-1]
        return logits.new_empty(shape, dtype=torch.bool), logits.new_empty(shape, dtype=torch.long)

    torch.library.register_fake("spd_fast::aggregate_cpp")(
        lambda rows, types, w: rows.new_empty(rows.shape[0], rows.shape[2]))
    torch.library.register_fake("spd_fast::verify_greedy_cpp")(lambda logits, draft: rows_out(logits))
    torch.library.register_fake("spd_fast::verify_sampling_cpp")(
        lambda logits, draft, q, t, k, p, u: rows_out(logits))
    torch.library.register_fake("spd_fast::draft_sample_cpp")(
        lambda logits, vocab, V, t, k, p, u: (logits.new_empty(logits.shape[:-1], dtype=torch.long),
                                              logits.new_empty(*logits.shape[:-1], V, dtype=torch.float32)))
    torch.library.register_fake("spd_fast::q4_1_linear")(lambda x, qs, d, m: x.new_empty(x.shape[0], d.shape[0]))
    torch.library.register_fake("spd_fast::q8_0_linear")(lambda x, qs, d: x.new_empty(x.shape[0], d.shape[0]))
    torch.library.register_fake("spd_fast::rms_norm_rows")(lambda x, w, eps: torch.empty_like(x))
    torch.library.register_fake("spd_fast::decode_attention")(
        lambda q, k_cache, v_cache, positions, kv_bound: q.new_empty(q.shape))


def available() -> bool:
    """True when the C++ ops are loaded (building them the first time); False with one warning."""
    if "ok" not in _state:
        try:
            _build()
            _state["ok"] = True
        except Exception as e:  # no compiler, missing headers, a failed build: the twins still work
            _state["ok"] = False
            why = _first_cause(str(e))
            warnings.warn(f"spd_fast: C++ CPU ops unavailable ({type(e).__name__}: {why}); "
                          "using the PyTorch twins", RuntimeWarning, stacklevel=2)
    return bool(_state["ok"])


def op(name: str):
    """torch.ops.spd_fast.<name> (call `available()` first)."""
    return getattr(torch.ops.spd_fast, name)
