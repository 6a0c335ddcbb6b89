"""PDM training by teacher forcing (SPD_DESIGN.md section 5.3).

Per batch: one no-grad target forward records the anchor states h^{b_i} and the target's
next-token distribution; the head runs over m type-copies of the sequence under the structured
mask; the loss is KL(target || draft) over the draft vocabulary on the type-0 rows of assistant
positions whose target argmax lies in the draft vocabulary.
"""
from __future__ import annotations

import functools
import json
import random
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import SpdConfigError
from ..model import Transformer, apply_rope
from ..pdm import DraftConfig, DraftHead, init_from_target, set_draft_vocab
from ..progress import interactive
from ..runtime import model_identity
from ..store import replace_durably, write_text_durably
from . import heap
from .mask import structured_mask


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    lr: float = 5e-4
    warmup: int = 50
    batch_tokens: int = 2048        # tokens per optimisation step (sequences are packed greedily)
    max_seq_len: int = 512
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    argmax_weight: float = 0.0      # adds this times the cross-entropy on the target's argmax (greedy acceptance)
    fill_aug: float = 0.5           # probability of a step with a random fill f in [1, n-1]
    fill_after_miss: bool = False   # fill-f rows only where the head missed the token f back (as after a reject)
    seed: int = 0
    bf16: bool = False              # autocast the head (and teacher) to bf16
    save_every: int = 100
    log_every: int = 10
    time_budget: float = 0.0        # seconds; > 0 sets `steps` after 20 timed steps so training ends in time


def build_draft_vocab(samples: Sequence[dict], size: int, vocab_size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """`always`, then the most frequent response tokens, then the most frequent prompt tokens
    (then the lowest unused ids) up to `size`; returned sorted by token id."""
    resp: Counter = Counter()
    prompt: Counter = Counter()
    for s in samples:
        resp.update(s["response_ids"])
        prompt.update(s["prompt_ids"])
    ranked = [int(a) for a in always] + [t for t, _ in resp.most_common()] + [t for t, _ in prompt.most_common()]
    chosen = list(dict.fromkeys(ranked))[:size]
    taken = set(chosen)
    chosen += [t for t in range(vocab_size) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen))


def _layer_train(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 n_query: int) -> torch.Tensor:
    """A DecoderLayer without a KV cache; only the first `n_query` rows are computed as queries."""
    at = layer.attn
    B, R, _ = x.shape
    h = layer.attn_norm(x)
    q, k, v = at.wqkv(h).split([at.nh * at.hd, at.nkv * at.hd, at.nkv * at.hd], dim=-1)
    q = q[:, :n_query].reshape(B, n_query, at.nh, at.hd)
    k = k.reshape(B, R, at.nkv, at.hd)
    v = v.reshape(B, R, at.nkv, at.hd)
    if at.q_norm is not None:
        q, k = at.q_norm(q), at.k_norm(k)
    q = apply_rope(q, cos[:, :n_query], sin[:, :n_query])
    k = apply_rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, :, :n_query], enable_gqa=at.nh != at.nkv)
    y = x[:, :n_query] + at.wo(o.transpose(1, 2).reshape(B, n_query, at.nh * at.hd))
    return y + layer.mlp(layer.mlp_norm(y))


# loss rows per chunk of the LM head and KL (PdmTrainer.loss): each chunk's [rows, V_d] tensors (64 MiB in fp32 at
# V_d = 16,384) take the place of the whole step's, whose size changed with every batch's count of loss rows. On
# the CPU those blocks, of a new size every step, fragmented the heap: a 4-layer n=3 run of 8,192-token batches grew to
# 23 GB and was killed at step 165 (docs/TRAINING.md). Their recomputation in the backward pass costs one more
# [rows, H] x [H, V_d] product per chunk.
# Under torchrun the other ranks wait while rank 0 alone self-distils, builds the teacher cache (2 h on a 2-core
# CPU for 30k answers) or saves: in a barrier of their own gloo group with this timeout, not in the default
# group's, whose timeout (an hour) also bounds a hung collective. A rank that fails ends the whole job anyway
# (torchrun stops the others), so the long timeout does not turn an error into a hang.
LEAD_WAIT_S = 48 * 3600
_lead_group = None


def init_lead_wait() -> None:
    """Every rank calls this once, right after the process group starts (new_group is collective)."""
    global _lead_group
    from datetime import timedelta

    _lead_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=LEAD_WAIT_S))


def wait_for_lead() -> None:
    """A barrier where ranks wait for rank 0's work alone (see LEAD_WAIT_S)."""
    dist.barrier(group=_lead_group)


LOSS_CHUNK = 1024

# answer-position buckets of the validation report: [0, 64), [64, 128), [128, 192), [192, 256), [256, ...)
VAL_POS_EDGES = (64, 128, 192, 256)


class PdmTrainer:
    def __init__(self, target: Transformer, head: DraftHead, cfg: TrainConfig):
        self.target, self.head, self.cfg = target, head, cfg
        self.depth_type = head.dcfg.depth_types()
        self.n = head.dcfg.num_stages
        self.m = head.dcfg.num_types
        params = [p for n_, p in head.named_parameters() if not (head.dcfg.frozen_lm_head and n_ == "lm_head.weight")]
        if head.dcfg.frozen_lm_head:
            head.lm_head.weight.requires_grad_(False)
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.step = 0
        self.rng = random.Random(cfg.seed)
        self.total_steps = cfg.steps    # the LR schedule's length; a time budget may shorten it
        self.budget_done = False        # a time budget has fitted total_steps (kept across a resume)
        self.resumed_steps: int | None = None  # the saved run's --steps, after a resume
        self.train_seconds = 0.0        # wall clock spent in the training loop by this run, over all its resumes
        self.data_key: dict | None = None  # what `train` trains on (data_fingerprint): a resume on other data is refused
        self.model_key: str | None = None  # the teacher's model_identity: a resume against another model is refused
        # the --init head warm-started from ({"path", "digest"}; None from scratch): a resume with another is refused
        self.init_key: dict | None = None
        self.dev = target.device
        # data parallel (torchrun): every rank takes its own batches and gradients are averaged
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if self.world > 1:
            with torch.no_grad():  # identical starting weights on every rank
                for t in list(head.parameters()) + list(head.buffers()):
                    dist.broadcast(t.data, src=0)

    def all_reduce_grads(self) -> None:
        """Average the gradients over the ranks (one flat all-reduce): the step every rank then takes
        is that of the mean loss over all ranks' batches."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        off = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[off: off + g.numel()].view_as(p).to(p.dtype)
            off += g.numel()

    def to_dev(self, tensors):
        return tuple(t.to(self.dev, non_blocking=True) for t in tensors)

    def autocast(self):
        return torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def lr_at(self, step: int) -> float:
        """The lr of step `step` (from 0): linear warm-up, then linear decay that reaches 0 at `total_steps`, one
        past the last step taken; a run shorter than twice the warm-up (e.g.
        cut by a time budget) warms up over its first half only, so it still decays instead of ending on the ramp."""
        c = self.cfg
        warmup = min(c.warmup, self.total_steps // 2)
        if step < warmup:
            return c.lr * (step + 1) / warmup
        return c.lr * max(0.0, 1 - (step - warmup) / max(1, self.total_steps - warmup))

    @torch.no_grad()
    def teacher_forward(self, ids: torch.Tensor, lens: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One target forward -> (anchor states [B, T, H] each in fp32, full-vocabulary logits [B, T, V]
        in the compute dtype)."""
        tg, B, T = self.target, ids.shape[0], ids.shape[1]
        tg.setup_caches(B, max(tg.max_len, T))
        ar = torch.arange(T, device=ids.device)[None].expand(B, T)
        pos = torch.where(ar < lens[:, None], ar, torch.full_like(ar, tg.max_len))
        anchors = self.head.dcfg.anchors
        h, rec = tg.run_layers(tg.embed_tokens(ids), pos, 0, tg.cfg.num_layers, kv_bound=T, record=anchors)
        return [rec[b].float() for b in anchors], tg.lm_head(tg.norm(h))

    @torch.no_grad()
    def teacher(self, ids: torch.Tensor, lens: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """-> (anchor states [B, T, H] each, teacher log-probs over V_d [B, T, V_d], target argmax [B, T])."""
        anchors, logits = self.teacher_forward(ids, lens)
        # full-vocab logits in the compute dtype (bf16 under autocast): only their argmax is needed,
        # to tell whether the target's choice lies in the draft vocabulary
        dv = self.head.draft_vocab
        return anchors, torch.log_softmax(logits[..., dv].float(), -1), logits.argmax(-1)

    def teacher_from_cache(self, ids: torch.Tensor, states: torch.Tensor, layers: Sequence[int]
                           ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """From cached states ([B, T, k, H] at `layers`): the anchor states (h^0 is the embedding,
        recomputed) and h^L, from which the teacher distribution over V_d is rebuilt on the loss rows."""
        tg = self.target
        with torch.no_grad():
            anchors = [tg.embed_tokens(ids).float() if b == 0 else states[:, :, layers.index(b)].float()
                       for b in self.head.dcfg.anchors]
            h_last = states[:, :, layers.index(tg.cfg.num_layers)].float()
        return anchors, h_last

    def _teacher_lm_head(self) -> torch.Tensor:
        """The target's LM-head rows of the draft vocabulary (frozen; cached per draft vocabulary)."""
        dv = self.head.draft_vocab
        if getattr(self, "_w_dv_key", None) is not dv:
            self._w_dv, self._w_dv_key = self.target.lm_head.weight.detach()[dv].contiguous(), dv
        return self._w_dv

    def loss(self, ids: torch.Tensor, lens: torch.Tensor, loss_mask: torch.Tensor, fill: int | None,
             cached: tuple[torch.Tensor, torch.Tensor, Sequence[int]] | None = None,
             pos_edges: Sequence[int] = ()) -> tuple[torch.Tensor, dict]:
        """`cached` = (states [B, T, k, H], full-vocabulary target argmax [B, T], recorded layers) from
        the feature cache; without it the teacher runs live. With `pos_edges` (e.g. 64, 128), the stats
        also hold "by_pos": [agreeing rows, rows] per answer-position bucket [0, 64), [64, 128), [128, ...),
        answer position 0 being the row that predicts the first answer token."""
        head, B, T = self.head, ids.shape[0], ids.shape[1]
        if cached is None:
            anchors, t_logp_all, t_arg = self.teacher(ids, lens)
        else:
            anchors, h_last = self.teacher_from_cache(ids, cached[0], cached[2])
            t_arg = cached[1]
        # loss rows: assistant positions whose target argmax lies in the draft vocabulary; the LM
        # head, the softmaxes and the KL run on these rows only
        sel = (loss_mask & torch.isin(t_arg, head.draft_vocab)).reshape(-1).nonzero().squeeze(1)
        if fill is not None and self.cfg.fill_after_miss:
            sel = self.rows_after_miss(anchors, lens, sel, fill, t_arg)
        # the teacher's rows: log-probs over V_d (live), or h^L from which each chunk rebuilds them (cached)
        teacher = t_logp_all.reshape(B * T, -1)[sel] if cached is None else h_last.reshape(B * T, -1)[sel]
        rows, x = self.student_rows(anchors, lens, fill, sel)                              # [N, H]
        denom = max(int(sel.numel()), 1)
        # the LM head, softmaxes and KL run LOSS_CHUNK rows at a time, each chunk recomputed in the backward pass
        # (activation checkpointing): from the cache the [N, V_d] tensors are never whole (the live teacher's
        # log-probs are), so a step's largest blocks have one size whatever N is, and the CPU heap can reuse them
        # instead of growing (see LOSS_CHUNK)
        ce = ent = hard = torch.zeros((), device=rows.device)
        s_arg = []
        for a in range(0, int(sel.numel()), LOSS_CHUNK):
            args = (rows[a:a + LOSS_CHUNK], teacher[a:a + LOSS_CHUNK], cached is not None)
            c_ce, c_ent, c_hard, c_arg = (checkpoint(self._chunk_loss, *args, use_reentrant=False)
                                          if torch.is_grad_enabled() else self._chunk_loss(*args))
            ce, ent, hard = ce + c_ce, ent + c_ent, hard + c_hard
            s_arg.append(c_arg)
        s_arg = torch.cat(s_arg) if s_arg else torch.zeros(0, dtype=torch.long, device=rows.device)
        loss = ce / denom + 0.0 * x.sum()  # the zero term keeps a graph when no row counts
        if self.cfg.argmax_weight > 0 and sel.numel():
            loss = loss + self.cfg.argmax_weight * hard / denom
        kl = (ce.detach() - ent) / denom
        ok = head.draft_vocab[s_arg] == t_arg.reshape(-1)[sel]
        stats = {"loss": float(kl), "top1": float(ok.float().sum() / denom), "tokens": float(sel.numel())}
        if pos_edges:
            first = loss_mask.int().argmax(1)  # each sample's first loss row (its last prompt token)
            bucket = torch.bucketize(sel % T - first[sel // T], torch.tensor(list(pos_edges), device=sel.device),
                                     right=True)
            k = len(pos_edges) + 1
            hits = torch.bincount(bucket, weights=ok.double(), minlength=k).long().tolist()
            stats["by_pos"] = list(zip(hits, torch.bincount(bucket, minlength=k).tolist()))
        return loss, stats

    @torch.no_grad()
    def rows_after_miss(self, anchors: list[torch.Tensor], lens: torch.Tensor, sel: torch.Tensor, fill: int,
                        t_arg: torch.Tensor) -> torch.Tensor:
        """The loss rows `sel` (flat b * T + t) that the pipeline drafts at `fill` right after a reject and then
        verifies: at fill f the oldest in-flight token, t - f + 1, is the target's correction, so the head's
        full-fill draft of it (row t - f) missed; and the drafts made since, at fills 1 .. f-1 (rows t - f + 1
        .. t - 1), were right, else a later reject flushed row t's draft before it was verified. Fill
        augmentation otherwise draws fill-f rows at any position, where the head does better than after its
        own misses."""
        T = anchors[0].shape[1]
        flat = t_arg.reshape(-1)

        def right(f: int | None) -> torch.Tensor:  # per flat row: a loss row whose fill-f draft is the target's
            with torch.no_grad():  # a selection, not a loss term: no graph kept
                rows, _ = self.student_rows(anchors, lens, f, sel)
                # the LM head LOSS_CHUNK rows at a time: [N, V_d] logits of a new N every step fragment the heap
                arg = torch.cat([self.head.draft_logits(c).argmax(-1) for c in rows.split(LOSS_CHUNK)])
            ok = torch.zeros(flat.numel(), dtype=torch.bool, device=sel.device)
            ok[sel] = self.head.draft_vocab[arg] == flat[sel]
            return ok

        in_sel = torch.zeros(flat.numel(), dtype=torch.bool, device=sel.device)
        in_sel[sel] = True
        keep = sel % T >= fill
        back = (sel - fill).clamp_min(0)
        keep &= in_sel[back] & ~right(None)[back]
        for k in range(1, fill):
            keep &= right(k)[back + k]
        return sel[keep]

    def student_logits(self, anchors: list[torch.Tensor], lens: torch.Tensor, fill: int | None,
                       sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's draft logits [N, V_d] on the flattened rows `sel` of the type-0 copy (each row t as
        the newest token, older rows at the depths the pipeline gives them at `fill`), and the last
        layer's output [B, T, H]."""
        rows, x = self.student_rows(anchors, lens, fill, sel)
        return self.head.draft_logits(rows), x

    def student_rows(self, anchors: list[torch.Tensor], lens: torch.Tensor, fill: int | None,
                     sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`student_logits` before the head's final norm and LM head: the last layer's rows `sel` [N, H], and
        its whole output [B, T, H]."""
        head, m = self.head, self.m
        B, T = anchors[0].shape[0], anchors[0].shape[1]
        # type copies: copy a = W_a · concat(anchors 0..a)
        g = torch.cat([head.proj[a](torch.cat(anchors[: a + 1], dim=-1)) for a in range(m)], dim=1)  # [B, mT, H]
        dev = anchors[0].device
        pos = torch.arange(T, device=dev).repeat(m)
        cos, sin = head.rope_cos_train(pos)
        cos, sin = cos[None].expand(B, -1, -1), sin[None].expand(B, -1, -1)
        mask = structured_mask(T, self.depth_type, fill, device=dev)           # [mT, mT]
        key_ok = (torch.arange(T, device=dev)[None] < lens[:, None]).repeat(1, m)  # padded keys never seen
        mask = (mask[None] & key_ok[:, None, :])[:, None]                        # [B, 1, mT, mT]
        x = g
        L = len(head.layers)
        for i, layer in enumerate(head.layers):
            x = _layer_train(layer, x, cos, sin, mask, T if i == L - 1 else m * T)
        return x.reshape(B * T, -1)[sel], x

    def _chunk_loss(self, rows: torch.Tensor, teacher: torch.Tensor, from_cache: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk of loss rows -> (soft-target cross-entropy summed over the rows, the teacher's entropy, the
        hard-label cross-entropy on the teacher's argmax, the draft argmax per row). `teacher` holds log-probs
        over V_d, or (from_cache) h^L, turned into them here with the frozen final norm and LM-head rows."""
        s_logits = self.head.draft_logits(rows)                                            # [c, V_d] fp32
        with torch.no_grad():
            if from_cache:  # in the target's dtype, as its live forward runs (a bf16 target's rows met fp32 here)
                w = self._teacher_lm_head()
                t_logp = torch.log_softmax(F.linear(self.target.norm(teacher.to(w.dtype)), w).float(), -1)
            else:
                t_logp = teacher
            p_t = t_logp.exp()
            ent = -(p_t * t_logp).sum()
            s_arg = s_logits.argmax(-1)
        # KL(p_t || p_s) = CE(p_t, p_s) - H(p_t); H(p_t) does not depend on the head, so the gradient
        # is that of the fused soft-target cross-entropy (one pass each way over [c, V_d])
        ce = F.cross_entropy(s_logits, p_t, reduction="sum")
        # hard-label term: what greedy verification checks is the argmax, which the selected rows have inside
        # the draft vocabulary, so it is the argmax of the restricted teacher as well
        hard = (F.cross_entropy(s_logits, t_logp.argmax(-1), reduction="sum") if self.cfg.argmax_weight > 0
                else torch.zeros((), device=rows.device))
        return ce, ent, hard, s_arg

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   cached: tuple[torch.Tensor, torch.Tensor, Sequence[int]] | None = None) -> dict[str, float]:
        c = self.cfg
        fill = None
        if self.n > 1 and self.rng.random() < c.fill_aug:
            fill = self.rng.randint(1, self.n - 1)
        for gparam in self.opt.param_groups:
            gparam["lr"] = self.lr_at(self.step)
        self.head.train()
        batch = self.to_dev(batch)
        if cached is not None:
            cached = (*self.to_dev(cached[:2]), cached[2])
        with self.autocast():
            loss, stats = self.loss(*batch, fill=fill, cached=cached)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.world > 1:
            self.all_reduce_grads()
        norm = torch.nn.utils.clip_grad_norm_(self.params, c.grad_clip)
        if not torch.isfinite(norm):  # after the all-reduce: every rank sees the same norm and stops together
            raise SpdConfigError(f"training diverged at step {self.step}: the loss was {stats['loss']:.4g} and the "
                                 f"gradient norm {float(norm)} (lr {self.lr_at(self.step):.3g}); the checkpoints "
                                 f"saved so far are intact. Lower --lr, or check the data")
        self.opt.step()
        self.step += 1
        return stats

    @torch.no_grad()
    def validate(self, samples: Sequence[dict], batch_size: int = 8,
                 pos_edges: Sequence[int] = VAL_POS_EDGES, fill: int | None = None) -> dict:
        """KL and top-1 agreement with the target at full fill (the steady state of the pipeline) on
        held-out samples, teacher run live; weighted by loss rows. "val_top1_by_pos" splits the
        top-1 by answer position (buckets cut at `pos_edges`, e.g. "0-63", "64-127", "256+"; empty
        buckets left out), since a head trained on short answers loses agreement late in long ones.
        `fill` in [1, n-1] scores the warm-up depth pattern instead: only the `fill` newest tokens in
        flight, every older one committed at full depth (fill 1 is the information an EAGLE-style head
        has: the newest token's embedding over full-depth context)."""
        if fill is not None and not 1 <= fill < self.n:
            raise ValueError(f"fill {fill} is out of range for an n={self.n} head: pass 1..{self.n - 1}, "
                             "or None for full fill")
        was_training = self.head.training
        self.head.eval()
        kl = agree = rows = 0.0
        by_pos = [[0, 0] for _ in range(len(pos_edges) + 1)]
        try:
            for i in range(0, len(samples), batch_size):
                with self.autocast():
                    _, st = self.loss(*self.to_dev(collate(list(samples[i:i + batch_size]), self.cfg.max_seq_len)),
                                      fill=fill, pos_edges=pos_edges)
                kl += st["loss"] * st["tokens"]
                agree += st["top1"] * st["tokens"]
                rows += st["tokens"]
                for acc, (a, c) in zip(by_pos, st.get("by_pos", ())):
                    acc[0] += a
                    acc[1] += c
        finally:
            self.head.train(was_training)
            self.target.free_caches()  # the live teacher sized them for this batch
        # val_tokens: the rows scored (0 when no row's target argmax is in the draft vocabulary; then the rates are 0)
        out = {"val_loss": kl / max(rows, 1.0), "val_top1": agree / max(rows, 1.0), "val_tokens": rows}
        if pos_edges:
            lo = [0, *pos_edges]
            names = [f"{a}-{b - 1}" for a, b in zip(lo, pos_edges)] + [f"{pos_edges[-1]}+"]
            out["val_top1_by_pos"] = {n: a / c for n, (a, c) in zip(names, by_pos) if c}
            out["val_tokens_by_pos"] = {n: c for n, (_, c) in zip(names, by_pos) if c}
        return out

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.head.save(out / "head")
        torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                    "rng": self.rng.getstate(), "torch_rng": torch.get_rng_state(), "cfg": asdict(self.cfg),
                    "draft": json.loads(self.head.dcfg.to_json()), "total_steps": self.total_steps,
                    "budget_done": self.budget_done, "data": self.data_key, "train_seconds": self.train_seconds,
                    "teacher_dtype": str(self.target.embed.weight.dtype), "model": self.model_key,
                    "init": self.init_key, "world": self.world},
                   out / "trainer_state.pt.tmp")
        replace_durably(out / "trainer_state.pt.tmp", out / "trainer_state.pt")

    def resume(self, out: Path) -> bool:
        f = out / "trainer_state.pt"
        if not f.is_file():
            return False
        st = torch.load(f, weights_only=False, map_location=self.dev)
        mine = json.loads(self.head.dcfg.to_json())
        saved = st.get("draft", {})
        diff = [f"{k} {saved[k]} vs {mine.get(k)}" for k in RESUME_KEYS if k in saved and saved[k] != mine.get(k)]
        if diff:
            raise SpdConfigError(f"{out} holds a run of another head ({'; '.join(diff)}: saved vs asked); resume "
                                 f"it with its own options, or pass --no-resume (or another --out) to start over")
        old_data = st.get("data")  # absent in runs saved before the data were recorded
        if old_data is not None and self.data_key is not None and old_data != self.data_key:
            raise SpdConfigError(
                f"{out} holds a run trained on other data ({old_data['samples']} samples, fingerprint "
                f"{old_data['sha256']}; now {self.data_key['samples']}, {self.data_key['sha256']}): resuming would "
                f"train the rest of its schedule on these data; pass the run's own --data (same files, same "
                f"order) and --max-seq-len (it decides which samples are kept), or --no-resume (or another --out) "
                f"to start over, or another --out with --init {out}/head to fine-tune its head on these data")
        old_cfg = st.get("cfg", {})
        changed = [f"{flag} {old_cfg[k]} vs {getattr(self.cfg, k)}" for k, flag in RESUME_BATCH_FLAGS.items()
                   if k in old_cfg and old_cfg[k] != getattr(self.cfg, k)]
        if changed:  # they decide the batches (and which part of each sample is seen): another run's stream
            raise SpdConfigError(
                f"{out} holds a run with other batches ({'; '.join(changed)}: saved vs asked); resuming would not "
                f"continue on the batches it would have taken; pass the run's own values, or --no-resume (or another "
                f"--out) to start over, or another --out with --init {out}/head to fine-tune its head")
        # the rest of the recipe: a resume that took new values would train the rest of the run otherwise than it
        # began, and record only the new values (the saved ones are overwritten at the next checkpoint)
        settled = [f"{_flag(k)} {old_cfg[k]} vs {v}" for k, v in asdict(self.cfg).items()
                   if k in old_cfg and k not in RESUME_FREE and k not in RESUME_BATCH_FLAGS and old_cfg[k] != v]
        mine_dtype = str(self.target.embed.weight.dtype)
        if st.get("teacher_dtype", mine_dtype) != mine_dtype:  # absent in runs saved before it was recorded
            settled.append(f"--dtype {st['teacher_dtype'].removeprefix('torch.')} vs {mine_dtype.removeprefix('torch.')}")
        if settled:
            raise SpdConfigError(
                f"{out} holds a run trained with other settings ({'; '.join(settled)}: saved vs asked); a resume "
                f"continues the run as it began: pass its own values (its trainer_state.pt records them), or "
                f"--no-resume (or another --out) to start over, or another --out with --init {out}/head to fine-tune its head "
                f"with the new ones")
        self._check_resume_origin(out, st)
        try:
            self.head.load_state_dict(st["head"])
            self.opt.load_state_dict(st["opt"])
            for g in self.opt.param_groups:  # the saved groups carry the old run's value; this run's --weight-decay
                g["weight_decay"] = self.cfg.weight_decay  # counts (lr is set every step)
        except (RuntimeError, ValueError) as e:
            raise SpdConfigError(f"{out} holds a run whose head does not fit the one asked for ({str(e)[:200]}); "
                                 f"pass --no-resume (or another --out) to start over") from None
        self.resumed_steps = old_cfg.get("steps")
        self.step = st["step"]  # the LR schedule follows this run's steps (a resume may extend a run)
        if old_cfg.get("steps") == self.cfg.steps and "total_steps" in st:
            # the same run asked again: keep the length a time budget fitted it to (it ended there)
            self.total_steps, self.budget_done = st["total_steps"], st.get("budget_done", False)
            self.train_seconds = float(st.get("train_seconds", 0.0))  # a time budget counts the earlier sessions
        self.rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"].cpu())
        return True


    def _check_resume_origin(self, out: Path, st: dict) -> None:
        """Refuse a resume whose teacher model, --init head or rank count is not the saved run's (each absent in
        runs saved before it was recorded, which are not checked)."""
        fresh = (f"pass --no-resume (or another --out) to start over, or another --out with --init {out}/head to "
                 f"fine-tune its head")
        old_model = st.get("model")
        if old_model is not None and self.model_key is not None and old_model != self.model_key:
            raise SpdConfigError(
                f"{out} holds a run trained against another target model (model identity {old_model}, now "
                f"{self.model_key}: its config.json or weights differ); resuming would train the rest of it against "
                f"another teacher; pass the run's own --model, or {fresh}")
        if "init" in st and self.init_key is not None and self.init_key["digest"] is not None:
            old_init = st["init"]
            if old_init is None or old_init["digest"] != self.init_key["digest"]:
                began = ("from scratch" if old_init is None else
                         f"from the head {old_init['path']} (digest {old_init['digest']})")
                raise SpdConfigError(
                    f"{out} holds a run that began {began}, not from --init {self.init_key['path']} (digest "
                    f"{self.init_key['digest']}); a resume takes every weight from its checkpoint and would not read "
                    f"--init: drop --init (or pass the run's own) to resume it, or pass --no-resume (or another "
                    f"--out) to start from this --init")
        old_world = st.get("world")
        if old_world is not None and old_world != self.world:
            raise SpdConfigError(
                f"{out} holds a run trained on {old_world} rank(s), not {self.world}: each step takes one batch per "
                f"rank, so it would not continue on the batches it would have taken; resume it on {old_world} "
                f"rank(s) (torchrun --nproc-per-node {old_world}, or no torchrun for 1), or {fresh}")


def data_fingerprint(samples: Sequence[dict]) -> dict:
    """The training data's identity (every sample's prompt and answer ids, in order) for resume checks."""
    import hashlib
    from array import array

    h = hashlib.sha256()
    for smp in samples:
        for key in ("prompt_ids", "response_ids"):
            ids = smp[key]
            h.update(len(ids).to_bytes(8, "little"))
            h.update(array("q", ids).tobytes())
    return {"samples": len(samples), "sha256": h.hexdigest()[:16]}


def loss_rows(sample: dict, max_seq_len: int) -> int:
    """Positions of one sample that take a loss once it is cut to max_seq_len (see `collate`)."""
    P, L = len(sample["prompt_ids"]), min(max_seq_len, len(sample["prompt_ids"]) + len(sample["response_ids"]))
    return max(L - 1 - max(P - 1, 0), 0)


def drop_unlearnable(samples: Sequence[dict], max_seq_len: int, what: str = "samples") -> tuple[list[dict], dict]:
    """The samples with at least one loss position within max_seq_len, and counts of those dropped and cut
    short; an error when none is left (`what` names them in it, e.g. "validation samples")."""
    kept = [smp for smp in samples if loss_rows(smp, max_seq_len) > 0]
    counts = {"max_seq_len": max_seq_len, "dropped_samples": len(samples) - len(kept),
              "cut_samples": sum(len(smp["prompt_ids"]) + len(smp["response_ids"]) > max_seq_len for smp in kept)}
    if samples and not kept:
        shortest = min(len(smp["prompt_ids"]) for smp in samples)
        raise SpdConfigError(f"--max-seq-len {max_seq_len} leaves no answer token of any of the {len(samples)} "
                             f"{what} inside the window (the shortest prompt has {shortest} tokens); raise "
                             f"--max-seq-len to at least {max(shortest, 1) + 1}")
    return kept, counts


def pack_batches(samples: Sequence[dict], batch_tokens: int, max_seq_len: int, seed: int, epoch: int
                 ) -> list[list[dict]]:
    """Shuffle (seeded per epoch), then group samples of similar length up to ~batch_tokens padded tokens."""
    rng = random.Random(seed * 1000 + epoch)
    order = list(samples)
    rng.shuffle(order)
    # sort within chunks of 64 for less padding, keep the global order random
    chunks = [sorted(order[i:i + 64], key=lambda s: len(s["prompt_ids"]) + len(s["response_ids"]))
              for i in range(0, len(order), 64)]
    batches, cur, cur_max = [], [], 0
    for ch in chunks:
        for s in ch:
            L = min(max_seq_len, len(s["prompt_ids"]) + len(s["response_ids"]))
            if cur and max(cur_max, L) * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(s)
            cur_max = max(cur_max, L)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


# Batches are padded to a multiple of this many positions (never past max_seq_len): a few distinct
# shapes instead of one per batch slow the growth of the CPU allocator's heap under bf16 autocast.
PAD_MULTIPLE = 64


def collate(batch: list[dict], max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> ids [B, T], lens [B], loss_mask [B, T] (positions t whose next token t+1 is an assistant token)."""
    seqs = [(s["prompt_ids"] + s["response_ids"])[:max_seq_len] for s in batch]
    T = max(len(s) for s in seqs)
    T = min(-(-T // PAD_MULTIPLE) * PAD_MULTIPLE, max_seq_len)  # seqs are cut to max_seq_len already
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, (s, smp) in enumerate(zip(seqs, batch)):
        ids[i, : len(s)] = torch.tensor(s)
        P = len(smp["prompt_ids"])
        if len(s) > 1:  # (an empty row's slice [0:-1] would mark the whole padded width)
            mask[i, max(P - 1, 0): len(s) - 1] = True
    return ids, torch.tensor([len(s) for s in seqs]), mask


def collate_cached(batch: list[dict], max_seq_len: int, cache
                   ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """`collate` plus the batch's cached teacher states [B, T, k, H] and full-vocabulary argmax [B, T]."""
    ids, lens, mask = collate(batch, max_seq_len)
    B, T = ids.shape
    states = torch.zeros(B, T, len(cache.layers), cache.states.shape[-1], dtype=torch.float16)
    arg = torch.zeros(B, T, dtype=torch.long)
    for r, s in enumerate(batch):
        st, am = cache.get(s["_idx"])
        states[r, : st.shape[0]] = st
        arg[r, : am.shape[0]] = am
    return (ids, lens, mask), (states, arg, cache.layers)


# TrainConfig fields a resumed run must share with the saved one (they decide its batches) -> their flags
RESUME_BATCH_FLAGS = {"max_seq_len": "--max-seq-len", "batch_tokens": "--batch-tokens", "seed": "--seed"}
# TrainConfig fields a resume may change: the run's length (a larger --steps or --epochs extends it; its LR schedule
# then decays over the new length), how often it logs and saves, its time budget, and its weight decay (set on the
# optimizer's groups at resume). Every other field must match the saved run's (PdmTrainer.resume).
RESUME_FREE = frozenset({"steps", "save_every", "log_every", "time_budget", "weight_decay"})


def _flag(field: str) -> str:
    """The command-line flag of a TrainConfig field (its own name when the train command has none: grad_clip)."""
    return field if field == "grad_clip" else "--" + field.replace("_", "-")
# draft_config fields a resumed run must share with the saved one (the weights' shape and meaning)
RESUME_KEYS = ("boundaries", "anchors", "num_layers", "draft_vocab_size", "base_fingerprint", "frozen_lm_head",
               "base_model_type", "base_hidden_size", "base_num_layers")


class TimeBudget:
    """Fit training into `seconds` of wall clock: time steps `start`..`start + measure` (after the
    first `start`, which include compilation and allocator warm-up), then set the trainer's total
    steps (and so its LR schedule, which decays to zero at the last step) to what fits in the rest,
    with `reserve` of the budget kept for checkpoints and validation. Never raises the total. The
    trainer's `train_seconds` (the time a resumed run spent before it stopped) counts as spent."""

    def __init__(self, seconds: float, trainer: PdmTrainer, start: int = 5, measure: int = 15, reserve: float = 0.15):
        self.seconds, self.trainer, self.start, self.measure, self.reserve = seconds, trainer, start, measure, reserve
        self.t_begin = time.perf_counter()
        self.first_step = trainer.step
        self.spent = trainer.train_seconds
        self.t_start: float | None = self.t_begin if start == 0 else None

    def after_step(self) -> int | None:
        """Call after every step; returns the new total once, when it is set."""
        done = self.trainer.step - self.first_step
        if done == self.start:
            self.t_start = time.perf_counter()
        if done != self.start + self.measure or self.t_start is None:
            return None
        per_step = (time.perf_counter() - self.t_start) / self.measure
        left = self.seconds * (1 - self.reserve) - self.spent - (time.perf_counter() - self.t_begin)
        total = min(self.trainer.total_steps, self.trainer.step + max(0, int(left / per_step)))
        if self.trainer.world > 1:  # every rank must stop at the same step: the slowest decides
            t = torch.tensor([total], device=self.trainer.dev)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            total = int(t.item())
        self.trainer.total_steps = max(total, self.trainer.step)
        self.trainer.budget_done = True
        return self.trainer.total_steps


def _read_json(path: Path) -> dict | None:
    """A small JSON record of the run (best_head/val.json, last_val.json); None if missing or unreadable (a
    write cut short by the end of a session)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _write_json(path: Path, d: dict) -> None:
    write_text_durably(path, json.dumps(d))


def _rescore_best(trainer: PdmTrainer, val_samples: Sequence[dict], out: Path, key: dict, old: dict,
                  log) -> dict | None:
    """Score out/best_head on `val_samples`, the validation data of this (resumed) run, which differ from the data
    it was chosen on; its val.json then records this score. None (a best head no longer kept) if it cannot be read."""
    from ..pdm import load_draft

    try:
        best = load_draft(out / "best_head", trainer.target, trainer.head.dcfg.base_fingerprint,
                          device=trainer.dev).requires_grad_(False)
    except (SpdConfigError, OSError, ValueError) as e:
        log(f"{out / 'best_head'} cannot be read ({str(e)[:200]}); the next validation replaces it")
        return None
    mine = trainer.head
    trainer.head = best
    try:
        v = trainer.validate(val_samples)
    finally:
        trainer.head = mine
    rec = dict(v, step=old.get("step"), val_data=key)
    _write_json(out / "best_head" / "val.json", rec)
    log(f"{out / 'best_head'} (step {old.get('step')}) was chosen on other validation data; on these it scores "
        f"top-1 {v['val_top1']:.4f}, the figure later checkpoints must beat")
    return rec


def _validate(trainer: PdmTrainer, val_samples: Sequence[dict], out: Path, log) -> None:
    key = data_fingerprint(val_samples)  # best_head's score counts only on the data it was taken on
    best_f = out / "best_head" / "val.json"
    rec = _read_json(best_f)
    if rec is not None and rec.get("val_data") != key:
        rec = _rescore_best(trainer, val_samples, out, key, rec, log)
    v = trainer.validate(val_samples)
    best = (rec or {}).get("val_top1", -1.0)
    improved = v["val_tokens"] > 0 and v["val_top1"] > best  # no scored row is no evidence of anything
    if improved:
        trainer.head.save(out / "best_head")
        _write_json(best_f, dict(v, step=trainer.step, val_data=key))
    if not v["val_tokens"]:
        log(f"validation scored no row: no answer token of the {len(val_samples)} validation samples has its target "
            f"argmax in the {trainer.head.dcfg.draft_vocab_size}-token draft vocabulary (or inside --max-seq-len); "
            f"raise --draft-vocab or pass --val data like the training data")
    rounded = {k: ({b: round(y, 4) for b, y in x.items()} if isinstance(x, dict) else round(x, 4)) for k, x in v.items()}
    log(json.dumps({"step": trainer.step, **rounded, "best": improved}))
    # after the log line: a run stopped between the two validates again at resume and logs it then
    _write_json(out / "last_val.json", {"step": trainer.step})  # a resume scores a checkpoint this missed


def epoch_steps(count, epochs: float) -> int:
    """Steps in `epochs` epochs when epoch e has count(e) steps (each epoch packs its batches anew, so the
    counts differ by a batch or so): the whole epochs' own counts plus the fraction of the next one's."""
    whole = int(epochs)
    return sum(count(e) for e in range(whole)) + int((epochs - whole) * count(whole))


def locate_step(count, step: int) -> tuple[int, int]:
    """(epoch, steps done in it) of global step `step` when epoch e has count(e) steps."""
    epoch = 0
    while step >= (c := count(epoch)):
        if c == 0:
            raise SpdConfigError(f"epoch {epoch} packs no batch for every rank; lower --batch-tokens or use fewer "
                                 "processes")
        step -= c
        epoch += 1
    return epoch, step


def warm_start(head: DraftHead, init: str | Path, target_obj) -> None:
    """Copy a saved head's weights and draft vocabulary into `head` (same anchors and V_d).

    The stage split may differ: every weight depends on the anchors only, so a head trained for one
    n is a starting point for another n with the same anchors (e.g. the n=3 head with anchors
    0,10,20,30 for n=2 at boundaries 0,15,30, where a depth-1 token has type 1); fine-tuning then
    teaches it the new split's depth pattern.

    `head` may have more decoder layers than the saved one (growing L_s): the saved layers become
    the first ones and each extra layer starts as the identity (its attention output and MLP down
    projections zeroed, so both residual branches add nothing), so the grown head drafts exactly
    like the saved one at step 0 and training only has to learn what the new depth adds."""
    from ..pdm import load_draft

    src = load_draft(init, target_obj.model, target_obj.fingerprint)
    a, b = src.dcfg, head.dcfg
    diffs = []
    if a.anchors != b.anchors:
        hint = (f" (a head for another stage split keeps its anchors: add --anchors {','.join(map(str, a.anchors))})"
                if a.boundaries != b.boundaries else "")
        diffs.append(f"anchors: {list(a.anchors)} vs {list(b.anchors)}{hint}")
    if a.draft_vocab_size != b.draft_vocab_size:
        diffs.append(f"draft_vocab_size: {a.draft_vocab_size} vs {b.draft_vocab_size}")
    if not a.frozen_lm_head and b.frozen_lm_head:
        diffs.append("lm_head: trained in the saved head, frozen in the requested one (add --train-lm-head, or "
                     "its trained rows would be replaced by the target's)")
    if a.num_layers > b.num_layers:
        diffs.append(f"num_layers: {a.num_layers} vs {b.num_layers} (a head can be grown, not shrunk)")
    if diffs:
        raise SpdConfigError(f"cannot warm-start from {init}: it differs from the requested head ("
                             + "; ".join(diffs) + "); pass matching --num-stages/--anchors/--draft-layers/"
                             "--draft-vocab or drop --init")
    with torch.no_grad():  # weights, the draft_vocab buffer and the (target-rebuilt) LM-head rows
        missing, unexpected = head.load_state_dict(src.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("layers.") for k in missing), (missing, unexpected)
        for layer in head.layers[a.num_layers:]:
            layer.attn.wo.weight.zero_()
            layer.mlp.w_down.weight.zero_()


def train(target_obj, samples: Sequence[dict], out_dir: str | Path, num_stages: int = 3,
          boundaries: Sequence[int] | None = None, anchors: Sequence[int] | None = None, draft_layers: int = 1,
          draft_vocab_size: int = 16384, cfg: TrainConfig = TrainConfig(), resume: bool = True,
          log=print, feature_cache: bool = True, init: str | Path | None = None,
          val_samples: Sequence[dict] = (), train_lm_head: bool = False) -> DraftHead:
    """Train a PDM for `target_obj` (a runtime.Target) on `samples` ({"prompt_ids", "response_ids"}).

    With `feature_cache`, the teacher runs once over all samples first and its states are stored
    under out_dir/feature_cache (see features.py); every step then reads them instead of running
    the 30-layer target again.

    `init` warm-starts from a saved head (its weights and its draft vocabulary; anchors and V_d
    must match, n and L_s may differ / grow, see warm_start): fine-tuning an existing head on new data is much
    cheaper than starting over.

    `val_samples` (held-out data) are scored at every checkpoint (KL and top-1 agreement at full
    fill), and at step 0 of a warm start; the head with the best top-1 so far is also kept in
    out_dir/best_head, so a fine-tune that never beats its `init` leaves that head there.

    `train_lm_head` also trains the head's LM-head rows (initialised from the target's), which adds
    capacity at no inference cost but stores V_d x H more weights in the checkpoint."""
    from ..config import uniform_boundaries

    torch.manual_seed(cfg.seed)
    tgt = target_obj.model
    out = Path(out_dir)
    b = tuple(boundaries) if boundaries is not None else uniform_boundaries(tgt.cfg.num_layers, num_stages)
    vd = min(draft_vocab_size, tgt.cfg.vocab_size)
    dcfg = DraftConfig.make(tgt.cfg, b, tuple(anchors) if anchors is not None else None, draft_layers, vd,
                            target_obj.fingerprint, frozen_lm_head=not train_lm_head)
    head = init_from_target(DraftHead(dcfg, tgt.cfg, tgt.norm), tgt, cfg.seed)
    if init is None:
        set_draft_vocab(head, build_draft_vocab(samples, vd, tgt.cfg.vocab_size, target_obj.eos_ids), tgt)
    elif not (resume and (out / "trainer_state.pt").is_file()):  # a resume takes every weight and the draft
        warm_start(head, init, target_obj)  # vocabulary from its checkpoint: `init` is not read (it may be gone)
    head.to(tgt.device)  # fp32 master weights on the target's device (bf16 compute under autocast)
    samples, _ = drop_unlearnable(samples, cfg.max_seq_len)
    trainer = PdmTrainer(tgt, head, cfg)
    trainer.data_key = data_fingerprint(samples)
    identity = model_identity(tgt)  # also the feature cache's key
    trainer.model_key = identity
    if init is not None:  # at a resume the --init directory may be gone: then it is not checked
        from ..pdm import head_digest

        try:
            digest: str | None = head_digest(init)
        except (OSError, ValueError, SpdConfigError):
            digest = None
        trainer.init_key = {"path": str(Path(init).resolve()), "digest": digest}
    rank, world = trainer.rank, trainer.world
    lead = rank == 0  # under torchrun only rank 0 logs, validates and writes checkpoints
    if not lead:
        log = _quiet
    if resume and trainer.resume(out):
        # readers of the log drop the earlier lines past this step: the run took them again from its checkpoint
        rec = {"message": f"resumed from {out} at step {trainer.step}", "resumed_at": trainer.step,
               "steps": trainer.total_steps}
        if trainer.resumed_steps not in (None, cfg.steps):
            rec["steps_before"] = trainer.resumed_steps  # a longer run: the LR schedule now decays over the new length
        log(json.dumps(rec))
        last_val = (_read_json(out / "last_val.json") or {}).get("step", -1)
        if lead and val_samples and last_val < trainer.step:  # the run stopped during this checkpoint's validation
            _validate(trainer, val_samples, out, log)
        if trainer.step >= trainer.total_steps:
            log(f"the run in {out} had already finished ({trainer.step} steps): nothing to train; pass a larger "
                f"--steps (or --epochs, which sets the step count) to extend it, or --no-resume to start over")
            head.eval()  # its head (and a calibration written into it since) stays as it is
            return head
    else:
        if lead and (out / "best_head").is_dir():
            shutil.rmtree(out / "best_head")  # an earlier run's: this one's validations must not be judged against it
            log(f"removed {out / 'best_head'} of an earlier run (a fresh start)")
        if lead:
            (out / "last_val.json").unlink(missing_ok=True)
            # the discarded run's state: a later resume, after this run stopped before its first checkpoint, must
            # not pick it up and train it on with this run's settings
            (out / "trainer_state.pt").unlink(missing_ok=True)
    cache = None
    if feature_cache:
        from .features import build_feature_caches

        t_c = time.perf_counter()
        if not lead:
            wait_for_lead()  # rank 0 builds the cache first; the others then open it
        cache = build_feature_caches(tgt, identity, samples, out / "feature_cache", dcfg.anchors,
                                    cfg.max_seq_len, batch_tokens=4096, bf16=cfg.bf16, progress=interactive() and lead)
        if lead and world > 1:
            wait_for_lead()
        samples = [dict(s, _idx=i) for i, s in enumerate(samples)]
        tgt.free_caches()  # the teacher pass sized them for its largest batch (GBs); training reads the cache
        log(json.dumps({"feature_cache": str(cache.root), "seconds": round(time.perf_counter() - t_c, 1)}))
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        write_text_durably(out / "train_config.json", json.dumps(
            {"train": asdict(cfg), "draft": json.loads(dcfg.to_json()), "samples": len(samples), "ranks": world},
            indent=2))
    if lead and val_samples and init is not None and trainer.step == 0:
        _validate(trainer, val_samples, out, log)  # the warm-start head: the score the fine-tune must beat

    def rank_batches(epoch: int) -> list[list[dict]]:
        """This rank's share of the epoch's batches (every rank the same count; a remainder is dropped)."""
        bs = pack_batches(samples, cfg.batch_tokens, cfg.max_seq_len, cfg.seed, epoch)
        return bs[rank: len(bs) // world * world: world]

    @functools.cache
    def count(e: int) -> int:
        return len(rank_batches(e))

    if count(0) == 0:
        raise SpdConfigError(f"{len(samples)} samples make fewer batches than the {world} ranks; lower "
                             "--batch-tokens, add data or use fewer processes")
    epoch, done_in_epoch = locate_step(count, trainer.step)  # each epoch's own batch count
    t0, toks, agg = time.perf_counter(), 0.0, []
    budget = TimeBudget(cfg.time_budget, trainer) if cfg.time_budget > 0 and not trainer.budget_done else None
    t_loop, spent0 = time.perf_counter(), trainer.train_seconds

    def save() -> None:
        trainer.train_seconds = spent0 + (time.perf_counter() - t_loop)
        trainer.save(out)
    pbar = None
    if interactive() and lead:
        from tqdm import tqdm
        pbar = tqdm(total=cfg.steps, initial=trainer.step, desc="train PDM")
    warned_empty = False
    while trainer.step < trainer.total_steps:
        batches = rank_batches(epoch)[done_in_epoch:]
        for bt in batches:
            if trainer.step >= trainer.total_steps:
                break
            if cache is not None:
                batch, cached = collate_cached(bt, cfg.max_seq_len, cache)
                stats = trainer.train_step(batch, cached)
            else:
                stats = trainer.train_step(collate(bt, cfg.max_seq_len))
            toks += stats["tokens"] * world  # this rank's loss rows; the others take as many on average
            if not stats["tokens"] and not warned_empty:  # once per run: a step that could not learn anything
                warned_empty = True
                log(f"step {trainer.step} had no loss row: no answer token of its batch has its target argmax in the "
                    f"{trainer.head.dcfg.draft_vocab_size}-token draft vocabulary, so it learnt nothing; raise "
                    f"--draft-vocab if this recurs (the loss and tokens/s then stay at 0)")
            if trainer.dev.type == "cpu" and trainer.step % heap.TRIM_EVERY == 0:
                heap.trim()  # shapes change every step: keep freed heap pages from piling up
            agg.append(stats)
            if budget is not None and (steps := budget.after_step()) is not None:
                log(json.dumps({"time_budget_s": cfg.time_budget, "steps": steps}))
                if pbar is not None:
                    pbar.total = steps
            if pbar is not None:
                pbar.update(1)
                pbar.set_postfix(loss=f"{stats['loss']:.3f}", top1=f"{stats['top1']:.3f}",
                                 tok_s=f"{toks / (time.perf_counter() - t0):.0f}")
            # every log_every steps, and the run's first and last steps too: a run shorter than log_every shows its
            # loss. Each line is the mean over the steps since the last multiple of log_every (of this run).
            if trainer.step % cfg.log_every == 0 or trainer.step == 1 or trainer.step >= trainer.total_steps:
                k = agg[-min(trainer.step % cfg.log_every or cfg.log_every, len(agg)):]
                # the lr the step just taken used (steps count from 1 in the log, from 0 in lr_at)
                log(json.dumps({"step": trainer.step, "epoch": epoch, "lr": trainer.lr_at(trainer.step - 1),
                                "loss": sum(s["loss"] for s in k) / len(k), "top1": sum(s["top1"] for s in k) / len(k),
                                "tokens_per_s": toks / (time.perf_counter() - t0)}))
            if lead and (trainer.step % cfg.save_every == 0 or trainer.step == trainer.total_steps):
                save()
                if val_samples:
                    _validate(trainer, val_samples, out, log)
        epoch, done_in_epoch = epoch + 1, 0
    if pbar is not None:
        pbar.close()
    if lead:
        save()
    if world > 1:
        wait_for_lead()  # the others wait for rank 0's last checkpoint
    head.eval()
    return head


def _quiet(msg: str) -> None:
    """The log of ranks other than 0 under torchrun."""
