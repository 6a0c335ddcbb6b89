"""placement="distributed": SPD with one pipeline stage per torch.distributed rank (gloo / NCCL).

    torchrun --nproc-per-node 2 -m spd_fast.distributed --user "Write a haiku about rain."

or, inside any torchrun job (every rank runs the same script):

    out = spd_fast.generate(prompt, num_stages=2, placement="distributed")   # None on ranks != 0

Module map: launch.py (rendezvous, process group, startup handshake), partial_load.py (a stage's
tensors straight from safetensors), comm.py (messages, timeouts, fault hook), executor.py (rank 0's
driver and the stage workers), engine.py (load_distributed / DistributedEngine), __main__.py (CLI).
See docs/DISTRIBUTED.md.
"""
from __future__ import annotations

from .comm import RankFailure
from .engine import DistributedEngine, Request, load_distributed
from .launch import DistributedConfigError, shutdown

__all__ = ["DistributedConfigError", "DistributedEngine", "RankFailure", "Request", "load_distributed", "shutdown"]
