"""The structured attention mask of PDM training (SPD_DESIGN.md section 5.3).

The training sequence is laid out as m copies, one per feature type; copy a holds every position
as a row of type a (its smallest depth d_a). A query of type a at position t sees key (a', t') iff
t' <= t and a' is the type the key has at inference when the query's row is at depth d_a:
depth(k) = d_a + k for the distance k = t - t', except that keys as deep as the current fill f
are committed, i.e. depth n. With full fill (f = n) this is min(n, d_a + k).
"""
from __future__ import annotations

import torch


def min_depth_of_type(depth_type: list[int]) -> list[int]:
    """d_a: the smallest depth whose type is a (depth_type lists t(d) for d = 0..n)."""
    m = max(depth_type) + 1
    return [depth_type.index(a) if a in depth_type else len(depth_type) - 1 for a in range(m)]


def structured_mask(T: int, depth_type: list[int], fill: int | None = None,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """[m*T, m*T] bool, rows/cols ordered (type, position)."""
    n = len(depth_type) - 1
    f = n if fill is None else fill
    m = max(depth_type) + 1
    d_min = torch.tensor(min_depth_of_type(depth_type), device=device)
    dt = torch.tensor(depth_type, device=device)
    t = torch.arange(T, device=device)
    k = t[:, None] - t[None, :]                                   # [T, T] distance query - key
    depth = d_min[:, None, None] + k.clamp_min(0)[None]            # [m, T, T]
    depth = torch.where(depth < f, depth, torch.full_like(depth, n)).clamp_max(n)
    key_type = dt[depth]                                           # [m, T, T]
    causal = (k >= 0)[None]
    mask = (key_type[:, :, None, :] == torch.arange(m, device=device)[None, None, :, None]) & causal[:, :, None, :]
    return mask.reshape(m * T, m * T)                              # [a, t, a', t'] -> rows (a, t), cols (a', t')


def brute_force_mask(T: int, depth_type: list[int], fill: int | None = None) -> torch.Tensor:
    """Reference by simulation: put the query row at depth d_a in a pipeline holding `fill` tokens
    and read off every older key's depth from the inference rule (in flight if it is among the
    `fill` newest tokens, else committed at depth n)."""
    n = len(depth_type) - 1
    f = n if fill is None else fill
    m = max(depth_type) + 1
    d_min = min_depth_of_type(depth_type)
    mask = torch.zeros(m, T, m, T, dtype=torch.bool)
    for a in range(m):
        for t in range(T):
            p_new = t + d_min[a]  # the newest in-flight position when this row is at depth d_a
            for tk in range(t + 1):
                in_flight = p_new - tk < f
                depth = p_new - tk if in_flight else n
                mask[a, t, depth_type[depth], tk] = True
    return mask.reshape(m * T, m * T)
