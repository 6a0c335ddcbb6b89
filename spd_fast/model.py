"""The Llama-family transformer (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3) with a static KV cache.

Shapes: B batch, T tokens per call, H hidden, S attended cache slots.
Every call takes `positions` [B, T] (int64 tensor): K/V are written to cache slot == position and a
query at position p attends to slots <= p. So a cache's valid length is implied by the positions of
the next call, and rolling a cache back is free: stale slots beyond the new position are masked
and later overwritten. `kv_bound` (a host int) only limits how many slots a call reads; it is a
multiple of KV_BLOCK derived from the largest position so that AR and SPD attend over the same
slots for the same token (same numerics, token-identical greedy output).
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

KV_BLOCK = 64
PACKED_MAX_ROWS = 16  # decode calls of at most this many rows use the C++ ops (packed linears, fused norm)


def available_bytes(device: torch.device) -> int | None:
    """Memory that can still be allocated on `device` (CUDA: free memory; CPU: Linux's MemAvailable),
    or None where it cannot be told."""
    if device.type == "cuda":  # free on the device, plus what torch's caching allocator holds unused
        return int(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                   - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_cache_fits(nbytes: int, device: torch.device, what: str, fix: str) -> None:
    """Refuse an allocation that cannot fit before trying it (the allocator's own error is a C++ trace)."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        from .config import SpdConfigError

        raise SpdConfigError(f"{what} needs {nbytes / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB is free on "
                             f"{device}; {fix}")


def kv_bound_for(max_position: int, max_len: int) -> int:
    """Number of cache slots to read for a query at `max_position` (rounded up to KV_BLOCK)."""
    return min(max_len, (max_position // KV_BLOCK + 1) * KV_BLOCK)


class Linear(nn.Linear):
    """nn.Linear that can also hold GGUF-packed blocks of its weight (spd_fast/packed.py): calls of
    at most PACKED_MAX_ROWS fp32 rows without autograd or autocast (the decode steps) read those
    instead of the fp32 weight; every other call (prefill, training) is F.linear."""

    packed: dict | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        if (p is not None and x.dtype == torch.float32 and 0 < x.numel() <= PACKED_MAX_ROWS * x.shape[-1]
                and x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad)
                and not torch.is_autocast_enabled("cpu")):
            from .packed import packed_linear

            y = packed_linear(x, p)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    fused = False  # set by packed.enable_fused_ops: decode rows go through one C++ op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.fused and x.dtype == torch.float32 and 0 < x.numel() <= PACKED_MAX_ROWS * x.shape[-1]
                and x.device.type == "cpu" and not torch.is_grad_enabled()):
            return torch.ops.spd_fast.rms_norm_rows(x.contiguous(), self.weight, self.eps)
        # Same op order as transformers' LlamaRMSNorm: normalise in fp32, cast, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    # fp32 arithmetic in the same order as transformers, so positions embed bit-identically.
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    rs = cfg.rope_scaling
    if rs:  # Llama 3.x frequency-dependent scaling
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_len / lo, old_len / hi
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rope_tables(cfg: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = rope_inv_freq(cfg)
    t = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def attention_mask(positions: torch.Tensor, kv_bound: int) -> torch.Tensor:
    """[B, 1, T, kv_bound] bool: a query at position p sees cache slots <= p."""
    slots = torch.arange(kv_bound, device=positions.device)
    return slots[None, None, None, :] <= positions[:, None, :, None]


def few_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Few-query attention as two small matmuls; the query heads of one KV group share a matmul
    (GQA without repeating K/V). q [B, T, nh, D], keys/values [B, nkv, S, D], mask [B, 1, T, S]
    -> [B, T, nh, D]. Softmax in fp32."""
    B, T, nh, D = q.shape
    nkv = keys.shape[1]
    g = nh // nkv
    qg = q.view(B, T, nkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, nkv, g * T, D)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * (D ** -0.5)               # [B, nkv, g*T, S]
    m = mask[:, :, None].expand(B, 1, g, T, -1).reshape(B, 1, g * T, -1)
    scores = scores.masked_fill(~m, float("-inf"))
    o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)   # [B, nkv, g*T, D]
    return o.view(B, nkv, g, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, nh, D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D]; cos/sin [B, T, D] (fp32). Half-split rotation, as in HF checkpoints."""
    d = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat([-xf[..., d:], xf[..., :d]], dim=-1)
    out = xf * cos[:, :, None] + rot * sin[:, :, None]
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = self.nh * self.hd, self.nkv * self.hd
        self.wqkv = Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias)
        self.wo = Linear(q_out, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.fused = False  # set by packed.enable_fused_ops: few-query attention as one C++ op

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_bound: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: [B, 1, T, kv_bound] bool (slot <= position), shared by all layers of one call."""
        B, T, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        qkv = self.wqkv(x)
        if self.q_norm is not None:
            q, k, v = qkv.split([nq, nk, nk], dim=-1)
            q, k = self.q_norm(q.view(B, T, self.nh, self.hd)), self.k_norm(k.view(B, T, self.nkv, self.hd))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # one rotation for the q and k heads together (elementwise: same numbers as two calls)
            qk = apply_rope(qkv[..., : nq + nk].view(B, T, self.nh + self.nkv, self.hd), cos, sin)
            q, k = qk[:, :, : self.nh], qk[:, :, self.nh:]
            v = qkv[..., nq + nk:]
        v = v.view(B, T, self.nkv, self.hd)
        kc, vc = self.k_cache, self.v_cache
        assert kc is not None, "call Transformer.setup_caches() before the forward"
        b_idx = torch.arange(B, device=x.device)[:, None]
        # Advanced indices around a slice: kc[b_idx, :, positions] has shape [B, T, nkv, D].
        kc[b_idx, :, positions] = k.to(kc.dtype)
        vc[b_idx, :, positions] = v.to(vc.dtype)
        if (self.fused and 0 < B * T and T <= 8 and q.dtype == torch.float32 and x.device.type == "cpu"
                and not torch.is_grad_enabled()):  # the fused ops are the C++ CPU ones
            o = torch.ops.spd_fast.decode_attention(q, kc, vc, positions.long().expand(B, T), kv_bound)
            return self.wo(o.reshape(B, T, self.nh * self.hd))
        keys, values = kc[:B, :, :kv_bound], vc[:B, :, :kv_bound]
        if mask is None:
            mask = attention_mask(positions, kv_bound)
        if T <= 8:
            o = few_query_attention(q, keys.to(q.dtype), values.to(q.dtype), mask)
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
                                               attn_mask=mask, enable_gqa=self.nh != self.nkv).transpose(1, 2)
        return self.wo(o.reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w_gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.inter, dim=-1)
        return self.w_down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, cos, sin, kv_bound, mask=None):
        x = x + self.attn(self.attn_norm(x), positions, cos, sin, kv_bound, mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Embedding, decoder layers and final norm + LM head as separately callable pieces."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.max_len = 0
        # bumped whenever the KV caches are (re)allocated: a captured CUDA graph holds the old buffers, so its
        # owner keys the capture on this
        self.cache_version = 0
        # generations started on these caches (by any Engine on this model), and reallocations, which end the
        # generation in progress: an open stream refuses to go on once this moved
        self.generations = 0
        # held by whoever decodes on these caches: generate() for its whole call, a stream while it computes a step
        self.decode_lock = threading.RLock()
        # a weak reference to the decode generator of the latest generation: the next one closes it, since it can
        # never go on, so a stream its caller still holds frees its state (SPD's anchor buffer: 4-75 MB) at once
        self.open_decode: Callable[[], Iterator[int] | None] | None = None
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def setup_caches(self, max_batch: int, max_len: int) -> None:
        """Allocate every layer's static KV cache [max_batch, kv_heads, max_len + 1, head_dim].

        Slot `max_len` is a scratch slot: writes that must not land anywhere go there.
        """
        cfg = self.cfg
        if self.max_len == max_len and self.layers[0].attn.k_cache is not None \
                and self.layers[0].attn.k_cache.shape[0] >= max_batch:
            return
        shape = (max_batch, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
        per_layer = 2 * math.prod(shape) * self.dtype.itemsize
        devices = {layer.attn.wqkv.weight.device for layer in self.layers}
        for dev in devices:  # several with placement="devices": each holds its own layers' caches
            mine = [layer.attn for layer in self.layers if layer.attn.wqkv.weight.device == dev]
            freed = sum(c.numel() * c.element_size() for a in mine for c in (a.k_cache, a.v_cache) if c is not None)
            fix = ("use a smaller max_len (the longest prompt plus new tokens it must hold)" if max_batch == 1
                   else "use a smaller max_len or batch (e.g. --gen-batch, --batch-tokens when training)")
            check_cache_fits(len(mine) * per_layer - freed, dev,
                             f"the KV cache for max_len={max_len} and batch {max_batch}", fix)
        # Normal tensors even when called under inference mode (the engine's decoder): an inference
        # tensor could never again be written, or read by a graph-recording op, outside it.
        with torch.inference_mode(False):
            for layer in self.layers:  # each layer's cache lives with its weights (placement="devices")
                dev = layer.attn.wqkv.weight.device
                layer.attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=dev)
                layer.attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=dev)
            cos, sin = rope_tables(cfg, max_len + 1)
            self.rope_cos, self.rope_sin = cos.to(self.device), sin.to(self.device)
        self.max_len = max_len
        self.cache_version += 1
        self.generations += 1  # whatever was decoding on the old caches cannot go on
        self.__dict__["_rope_by_device"] = {}

    def rope_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables on `device` (copied once per device when stages live on several GPUs)."""
        if self.rope_cos.device == device:
            return self.rope_cos, self.rope_sin
        per = self.__dict__.setdefault("_rope_by_device", {})
        if str(device) not in per:
            per[str(device)] = (self.rope_cos.to(device), self.rope_sin.to(device))
        return per[str(device)]

    def free_caches(self) -> None:
        """Drop the KV caches (e.g. after a large-batch teacher pass); setup_caches makes new ones."""
        for layer in self.layers:
            layer.attn.k_cache = layer.attn.v_cache = None
        self.max_len = 0
        self.generations += 1

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                   kv_bound: int | None = None, record: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run layers [start, end) on h [B, T, H]. Returns the output and {l: h^l} for l in `record`
        with start <= l <= end (h^l is the state after l layers, before the final norm)."""
        if kv_bound is None:
            kv_bound = kv_bound_for(int(positions.max()), self.max_len)
        cos_t, sin_t = self.rope_on(positions.device)
        cos, sin = cos_t[positions], sin_t[positions]
        mask = attention_mask(positions, kv_bound)
        recorded: dict[int, torch.Tensor] = {}
        if start in record:
            recorded[start] = h
        moves = self.__dict__.get("layer_devices")  # set by pipeline.place_stages (one stage per GPU)
        for li in range(start, end):
            if moves is not None and h.device != moves[li]:
                h, positions = h.to(moves[li]), positions.to(moves[li])
                cos_t, sin_t = self.rope_on(moves[li])
                cos, sin = cos_t[positions], sin_t[positions]
                mask = attention_mask(positions, kv_bound)
            h = self.layers[li](h, positions, cos, sin, kv_bound, mask)
            if li + 1 in record:
                recorded[li + 1] = h
        return h, recorded

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        # with one stage per GPU (pipeline.place_stages) the last layer's output lies on the last stage's GPU,
        # while the final norm and LM head stay on the model's device
        return self.lm_head(self.norm(h.to(self.norm.weight.device))).float()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv_bound: int | None = None) -> torch.Tensor:
        h, _ = self.run_layers(self.embed_tokens(ids), positions, 0, self.cfg.num_layers, kv_bound)
        return self.logits(h)


class Stage:
    """Layers [start, end) of a Transformer: one pipeline stage. Owns no weights of its own."""

    def __init__(self, model: Transformer, index: int, start: int, end: int):
        self.model, self.index, self.start, self.end = model, index, start, end

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv_bound: int | None = None,
                 record: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        return self.model.run_layers(h, positions, self.start, self.end, kv_bound, record)

    def __repr__(self) -> str:
        return f"Stage({self.index}, layers [{self.start}, {self.end}))"


def make_stages(model: Transformer, boundaries: tuple[int, ...]) -> list[Stage]:
    return [Stage(model, i, a, b) for i, (a, b) in enumerate(zip(boundaries, boundaries[1:]))]
