"""Joining the job: rendezvous settings, process group, and the startup handshake between ranks.

Startup is the only place with collectives (all_gather / broadcast of small Python objects); the
decode loop uses point-to-point messages only. Every startup step that can fail on one rank is
caught and its message gathered, so all ranks stop with the same clear error instead of the
healthy ones hanging in the next collective.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import SpdConfigError
from ..runtime import parse_device

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_HINT = "torchrun --nproc-per-node N -m spd_fast.distributed ..."


class DistributedConfigError(SpdConfigError):
    """A launch or configuration problem the user can fix (environment, world size, checkpoints)."""


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: float          # seconds a decode-time receive may wait before the peer is declared lost
    startup_timeout: float  # the same for startup collectives (loading a stage can take a while)


def _check_timeout(name: str, v: float) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 < v < float("inf")):
        raise DistributedConfigError(f"{name} must be a positive number of seconds, got {v!r}")
    return float(v)


def rendezvous_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables, or a clear error."""
    missing = [v for v in RENDEZVOUS_VARS if not os.environ.get(v)]
    if missing:
        raise DistributedConfigError(
            f"placement='distributed' needs the rendezvous settings {', '.join(RENDEZVOUS_VARS)}; missing: "
            f"{', '.join(missing)}. Launch every rank with `{LAUNCH_HINT}` (it sets them), or set them yourself "
            "(MASTER_ADDR/MASTER_PORT: the address rank 0 listens on)")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        int(os.environ["MASTER_PORT"])
    except ValueError as e:
        raise DistributedConfigError(f"a rendezvous variable is not an integer ({e}); check RANK, WORLD_SIZE, "
                                     "LOCAL_RANK and MASTER_PORT") from e
    if world < 1 or not 0 <= rank < world:
        raise DistributedConfigError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return rank, world, local


def init_rank(device: str = "cpu", timeout: float = 30.0, startup_timeout: float = 60.0) -> RankContext:
    """Join the process group (gloo on CPU, NCCL on CUDA); reuse one the caller already created."""
    timeout = _check_timeout("timeout", timeout)
    startup_timeout = max(timeout, _check_timeout("startup_timeout", startup_timeout))
    kind = parse_device(device).type  # 'cpu' or 'cuda' (present); each rank takes cuda:LOCAL_RANK
    backend = "gloo" if kind == "cpu" else "nccl"
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        backend = dist.get_backend()
    else:
        rank, world, local = rendezvous_env()
        if kind == "cuda" and local >= (gpus := torch.cuda.device_count()):  # before joining, which NCCL's would hang
            raise DistributedConfigError(f"LOCAL_RANK={local}, but this node has {gpus} GPU(s) and each rank takes "
                                         f"cuda:LOCAL_RANK; start at most {gpus} processes on this node "
                                         f"(torchrun --nproc-per-node {gpus})")
        try:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=startup_timeout))
        except Exception as e:  # noqa: BLE001 - the store's and gloo's errors: a rank that never came up
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise _lost(f"joining the process group at {where} (rank 0 hosts it; check MASTER_ADDR and MASTER_PORT "
                        f"if no rank reported an error)", startup_timeout, e) from None
    dev = torch.device("cpu") if kind == "cpu" else torch.device("cuda", local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return RankContext(rank, world, local, dev, backend, timeout, startup_timeout)


def _lost(step: str, seconds: float, e: BaseException) -> Exception:
    """A failed startup collective as one line: another rank stopped (its own error says why) or hung."""
    from .comm import RankFailure

    reason = " ".join(str(e).split())[:200]
    return RankFailure(f"startup failed while {step}: another rank stopped, or did not answer within {seconds:.0f} s "
                       f"({type(e).__name__}: {reason}); see the other ranks' own errors")


def gather_or_fail(ctx: RankContext, step: str, fn: Callable[[], Any]) -> list[Any]:
    """Run fn on every rank and all-gather the results; if any rank raised, every rank raises a
    DistributedConfigError naming the rank(s) and their messages."""
    try:
        mine: Any = ("ok", fn())
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised
        mine = ("error", f"{type(e).__name__}: {e}" if not isinstance(e, SpdConfigError) else str(e))
    out: list[Any] = [None] * ctx.world_size
    try:
        dist.all_gather_object(out, mine)
    except Exception as e:  # noqa: BLE001 - gloo/NCCL errors of a peer that died or hung
        raise _lost(step, ctx.startup_timeout, e) from None
    errors = [f"rank {r}: {v}" for r, (status, v) in enumerate(out) if status == "error"]
    if errors:
        raise DistributedConfigError(f"startup failed while {step}: " + "; ".join(errors))
    return [v for _, v in out]


def broadcast_from_rank0(ctx: RankContext, step: str, fn: Callable[[], Any]) -> Any:
    """Rank 0 computes fn(); every rank gets the result, or the same error if rank 0 raised."""
    box: list[Any] = [None]
    if ctx.rank == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001
            box[0] = ("error", str(e) if isinstance(e, SpdConfigError) else f"{type(e).__name__}: {e}")
    try:
        dist.broadcast_object_list(box, src=0)
    except Exception as e:  # noqa: BLE001
        raise _lost(step, ctx.startup_timeout, e) from None
    status, v = box[0]
    if status == "error":
        raise DistributedConfigError(f"startup failed while {step} on rank 0: {v}")
    return v


def check_same(descs: list[dict[str, Any]], keys: tuple[str, ...], what: str, fix: str) -> None:
    """Raise if the ranks' descriptors differ in any of `keys`."""
    for k in keys:
        vals = [d[k] for d in descs]
        if any(v != vals[0] for v in vals):
            per_rank = ", ".join(f"rank {r} ({d['host']}): {d[k]!r}" for r, d in enumerate(descs))
            raise DistributedConfigError(f"{what}: {k} differs across ranks ({per_rank}); {fix}")


def hostname() -> str:
    return socket.gethostname()


def shutdown() -> None:
    """Leave the process group (after a clean finish; after a failure just exit the process)."""
    if dist.is_initialized():
        dist.destroy_process_group()
