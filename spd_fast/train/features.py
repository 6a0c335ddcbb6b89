"""Teacher feature cache: one no-grad target forward per sample, stored on disk, reused every epoch.

The 30-layer teacher forward (plus a full-vocabulary LM head) costs more than the head's own
forward and backward, so doing it once instead of once per epoch is the largest saving in PDM
training. Per token the cache stores, in fp16:

- the hidden states h^b at every anchor b > 0 and at b = L (the state the target's final norm and
  LM head read); h^0 is the embedding and is recomputed from the token id for free;
- the target's argmax over the FULL vocabulary (int32), which decides whether a position counts
  in the loss (argmax inside the draft vocabulary).

The teacher distribution over the draft vocabulary is recomputed from h^L with the frozen final
norm and the LM-head rows of the draft vocabulary: a [T, H] x [H, V_d] GEMM, far cheaper than
storing V_d probabilities per token. Files: `states.npy` ([N_tokens, k, H] fp16, memory-mapped),
`argmax.npy` ([N_tokens] int32), `done.npy` (per-sample progress, so a build resumes), `meta.json`.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..config import SpdConfigError
from ..model import Transformer
from ..progress import bar
from ..store import replace_durably, write_text_durably
from . import heap

FORMAT_VERSION = 1


def _seq(s: dict, max_seq_len: int) -> list[int]:
    return (s["prompt_ids"] + s["response_ids"])[:max_seq_len]


def cache_key(fingerprint: str, layers: Sequence[int], max_seq_len: int, samples: Sequence[dict], bf16: bool,
              dtype: torch.dtype = torch.float32) -> str:
    h = hashlib.sha256()
    head = [FORMAT_VERSION, fingerprint, list(layers), max_seq_len, bf16]
    if dtype != torch.float32:  # the target's weights in another dtype give other states (fp32 keys unchanged)
        head.append(str(dtype))
    h.update(json.dumps(head).encode())
    for s in samples:
        h.update(json.dumps(_seq(s, max_seq_len)).encode())
    return h.hexdigest()[:16]


class FeatureCache:
    """Read side: `get(i)` -> (states [T_i, k, H] fp16, argmax [T_i] int64) of sample i."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.meta = json.loads((self.root / "meta.json").read_text())
        self.layers: list[int] = self.meta["layers"]
        self.offsets = np.asarray(self.meta["offsets"], dtype=np.int64)
        self.states = np.load(self.root / "states.npy", mmap_mode="r")
        self.argmax = np.load(self.root / "argmax.npy", mmap_mode="r")

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return torch.from_numpy(np.array(self.states[a:b])), torch.from_numpy(np.array(self.argmax[a:b])).long()


def _check_room(d: Path, fresh: bool, size: int) -> None:
    """The cache files are memory maps created sparse: a disk that fills up while the teacher writes them kills
    the process with SIGBUS ("Bus error") and no message, so the room they still need is checked first."""
    if fresh:
        need = size
    else:  # what a resumed build has not written yet
        need = sum(max(0, f.stat().st_size - f.stat().st_blocks * 512)
                   for f in (d / "states.npy", d / "argmax.npy") if f.is_file())
    free = shutil.disk_usage(d).free
    if need > free:
        raise SpdConfigError(f"the teacher feature cache needs {need / 2**30:.2f} GiB more in {d}, and only "
                             f"{free / 2**30:.2f} GiB is free; free space, use an --out on a larger disk, or pass "
                             f"--no-feature-cache (the teacher then runs at every step instead)")


def _save_atomic(path: Path, arr: np.ndarray) -> None:
    """np.save through a temporary file and a rename: a run killed mid-write leaves the previous file whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    replace_durably(tmp, path)


def _read_done(path: Path, count: int) -> np.ndarray | None:
    """The per-sample progress of an earlier build, or None (none, or a file that cannot be read or does not fit:
    the build then starts that cache again)."""
    if not path.is_file():
        return None
    try:
        done = np.load(path)
    except (ValueError, OSError, EOFError):
        return None
    return done if done.dtype == bool and done.shape == (count,) else None


@torch.no_grad()
def build_feature_cache(model: Transformer, fingerprint: str, samples: Sequence[dict], root: str | Path,
                        anchors: Sequence[int], max_seq_len: int = 512, batch_tokens: int = 4096,
                        bf16: bool = False, progress: bool = True) -> FeatureCache:
    """Run the teacher over `samples` once and store what training needs under root/<key>/.

    Resumable: samples already written (done.npy) are skipped; a finished cache is reused as is.
    The key covers the target's fingerprint, the recorded layers, max_seq_len, the token ids and
    the teacher precision (autocast and the target's dtype), so a cache never serves other data or another model.
    """
    L = model.cfg.num_layers
    layers = sorted({b for b in anchors if b > 0} | {L})
    key = cache_key(fingerprint, layers, max_seq_len, samples, bf16, model.embed.weight.dtype)
    d = Path(root) / key
    d.mkdir(parents=True, exist_ok=True)
    seqs = [_seq(s, max_seq_len) for s in samples]
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    N, H = int(offsets[-1]), model.cfg.hidden_size
    meta = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint, "layers": layers,
            "max_seq_len": max_seq_len, "bf16": bf16, "offsets": offsets.tolist(), "samples": len(seqs)}
    done_before = _read_done(d / "done.npy", len(seqs))
    if (d / "meta.json").is_file() and done_before is not None and bool(done_before.all()):
        return FeatureCache(d)
    # both arrays or neither: a build stopped between creating the two starts again (done.npy cannot be ahead of them)
    fresh = not ((d / "states.npy").is_file() and (d / "argmax.npy").is_file())
    _check_room(d, fresh, N * len(layers) * H * 2 + N * 4)
    states = np.lib.format.open_memmap(d / "states.npy", mode="w+" if fresh else "r+", dtype=np.float16,
                                       shape=(N, len(layers), H))
    argmax = np.lib.format.open_memmap(d / "argmax.npy", mode="w+" if fresh else "r+", dtype=np.int32, shape=(N,))
    done = np.zeros(len(seqs), dtype=bool) if fresh or done_before is None else done_before
    todo = sorted((i for i in range(len(seqs)) if not done[i]), key=lambda i: len(seqs[i]))
    model.free_caches()  # caches left by an earlier pass (self-distillation's, generation-sized) would set the size
    batches, cur = [], []
    for i in todo:  # similar lengths together: little padding
        if cur and len(seqs[i]) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    model.eval()
    for bi, batch in enumerate(bar(batches, "teacher features", enabled=progress)):
        T = max(len(seqs[i]) for i in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        lens = torch.tensor([len(seqs[i]) for i in batch])
        for r, i in enumerate(batch):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
        model.setup_caches(len(batch), max(model.max_len, T))
        ids, lens = ids.to(model.device), lens.to(model.device)
        ar = torch.arange(T, device=model.device)[None].expand(len(batch), T)
        pos = torch.where(ar < lens[:, None], ar, torch.full_like(ar, model.max_len))
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            h, rec = model.run_layers(model.embed_tokens(ids), pos, 0, L, kv_bound=T, record=tuple(layers))
            top = model.lm_head(model.norm(h)).argmax(-1)
        st = torch.stack([rec[b] for b in layers], dim=2).to(torch.float16).cpu().numpy()  # [B, T, k, H]
        top = top.cpu()
        for r, i in enumerate(batch):
            a, b = int(offsets[i]), int(offsets[i + 1])
            states[a:b] = st[r, : b - a]
            argmax[a:b] = top[r, : b - a].to(torch.int32).numpy()
            done[i] = True
        if bi % 20 == 19 or bi == len(batches) - 1:
            states.flush()
            argmax.flush()
            _save_atomic(d / "done.npy", done)
            if model.device.type == "cpu":
                heap.trim()
    write_text_durably(d / "meta.json", json.dumps(meta))
    _save_atomic(d / "done.npy", done)
    del states, argmax
    return FeatureCache(d)


class ConcatCache:
    """Several caches read as one: sample i of the concatenation (caches in order)."""

    def __init__(self, parts: Sequence[FeatureCache]):
        if not parts:
            raise ValueError("ConcatCache needs at least one cache")
        self.parts = list(parts)
        self.layers = self.parts[0].layers
        self.states = self.parts[0].states  # for its shape
        self.starts = np.cumsum([0] + [p.meta["samples"] for p in self.parts])

    @property
    def root(self) -> Path:
        return self.parts[0].root.parent

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k].get(i - int(self.starts[k]))


def build_feature_caches(model: Transformer, fingerprint: str, samples: Sequence[dict], root: str | Path,
                         anchors: Sequence[int], max_seq_len: int = 512, batch_tokens: int = 4096,
                         bf16: bool = False, progress: bool = True) -> ConcatCache:
    """One cache per run of samples from the same source (`_source`, set per --data file), so adding a
    data file to a run reuses the caches of the files it already had."""
    runs: list[list[dict]] = []
    for s in samples:
        if runs and runs[-1][0].get("_source") == s.get("_source"):
            runs[-1].append(s)
        else:
            runs.append([s])
    return ConcatCache([build_feature_cache(model, fingerprint, r, root, anchors, max_seq_len, batch_tokens, bf16,
                                            progress) for r in runs])
