"""The Pipeline Draft Module (PDM): multi-depth feature aggregation, a small decoder tower and an
LM head over a draft vocabulary (SPD_DESIGN.md section 5).

Anchors B = (b_0 = 0 < ... < b_{m-1} <= L) are the layer indices whose hidden states the PDM reads.
A token at depth d (it finished layers < c_d) has type t(d) = max{i : b_i <= c_d}; its feature is
g = W_t · concat(h^{b_0}, ..., h^{b_t}).
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from .config import ModelConfig, SpdConfigError, check_layer_indices, validate_boundaries
from .store import replace_durably, write_text_durably
from .model import PACKED_MAX_ROWS, DecoderLayer, Linear, RMSNorm, attention_mask, rope_tables

FORMAT_VERSION = 1
WEIGHTS_FILE = "draft.safetensors"
SCALE_RANGE = (0.05, 20.0)  # allowed draft_temperature_scale
NO_LOOKUP_GATE = (1.0, 0.0)  # (lookup_gate_confidence, lookup_gate_ratio) that never keeps the PDM's draft
COPY_BOOST_MAX = 30.0  # largest lookup_copy_boost (a logit offset; 30 already makes the copy all but certain)


def valid_scale(s: object) -> bool:
    """A draft_temperature_scale a head may carry: a real number (not a bool) inside SCALE_RANGE."""
    return isinstance(s, (int, float)) and not isinstance(s, bool) and SCALE_RANGE[0] <= s <= SCALE_RANGE[1]


def valid_fraction(v: object) -> bool:
    """A lookup-gate parameter: a real number (not a bool) in [0, 1]."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0


def gate_keeps_pdm(top, p_copy, inside, confidence: float, ratio: float):
    """The lookup gate's rule, for floats/bools or tensors alike: True where the PDM keeps its own draft over
    a context copy: the copied token lies inside the draft vocabulary (`inside`; one outside it, the PDM
    could never draft, and on held-out answers such a copy was right 414 times in 452), the PDM's top
    probability `top` exceeds `confidence` and the copied token's probability `p_copy` is below `ratio`
    times it. Used by the drafter and by the calibration."""
    return (top > confidence) & (p_copy < ratio * top) & inside


def valid_boost(v: object) -> bool:
    """A lookup_copy_boost: None (copies drafted one-hot) or a real number (not a bool) in [0, COPY_BOOST_MAX]."""
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= COPY_BOOST_MAX)


def draft_vocab_slots(draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """full vocabulary id -> its row in the draft vocabulary; V_d for ids outside it."""
    n = draft_vocab.numel()
    slot = torch.full((vocab_size,), n, dtype=torch.long, device=draft_vocab.device)
    return slot.scatter_(0, draft_vocab.long(), torch.arange(n, device=draft_vocab.device))


class DraftMismatchError(SpdConfigError):
    """A draft head that does not fit the target model or the requested pipeline."""


@dataclass(frozen=True)
class DraftConfig:
    num_stages: int
    boundaries: tuple[int, ...]
    anchors: tuple[int, ...]
    num_layers: int = 1            # L_s
    draft_vocab_size: int = 0      # filled from the draft vocabulary
    base_model_type: str = ""
    base_hidden_size: int = 0
    base_num_layers: int = 0
    base_vocab_size: int = 0
    base_fingerprint: str = ""
    frozen_lm_head: bool = True    # LM head = the target's rows of the draft vocabulary (not saved)
    format_version: int = FORMAT_VERSION
    # sampled decoding: the head drafts at temperature T * this (its own calibration, see
    # train/calibrate.py); q is still the distribution the draft was drawn from, so output stays exact
    draft_temperature_scale: float = 1.0
    # context lookup gate (drafters.PdmDrafter, calibrated by train/calibrate.py): a context copy replaces
    # the PDM's draft unless the PDM's top probability exceeds `confidence` AND the copied token's PDM
    # probability is below `ratio` times that top probability. (1.0, 0.0) always copies.
    lookup_gate_confidence: float = NO_LOOKUP_GATE[0]
    lookup_gate_ratio: float = NO_LOOKUP_GATE[1]
    # sampled decoding (T > 0) with context lookup: None drafts a gated copy with a one-hot q; a number d
    # instead adds d to the copied token's temperature-scaled PDM logit on every match (copies inside the
    # draft vocabulary) and samples from that q (calibrated by train/calibrate.py; exact either way)
    lookup_copy_boost: float | None = None
    # the weights file, relative to the head directory: a head that shares another head's weights
    # (the shipped n=2 head reads the n=3 head's) names that file; save() always writes its own
    weights: str = WEIGHTS_FILE

    def __post_init__(self) -> None:
        s = self.draft_temperature_scale
        if not valid_scale(s):
            raise DraftMismatchError(f"draft_temperature_scale {s!r} is out of range: it must be a number in "
                                     f"[{SCALE_RANGE[0]}, {SCALE_RANGE[1]}] (1 = draft at the requested temperature); "
                                     "fix draft_config.json or the calibration's --scales")
        for name in ("lookup_gate_confidence", "lookup_gate_ratio"):
            v = getattr(self, name)
            if not valid_fraction(v):
                raise DraftMismatchError(f"{name} {v!r} is out of range: it must be a number in [0, 1] "
                                         f"(the defaults {NO_LOOKUP_GATE[0]} and {NO_LOOKUP_GATE[1]} let every "
                                         "context match replace the PDM's draft); fix draft_config.json or the "
                                         "calibration's --gate-confidences / --gate-ratios")
        if not valid_boost(self.lookup_copy_boost):
            raise DraftMismatchError(f"lookup_copy_boost {self.lookup_copy_boost!r} is out of range: it must be null "
                                     f"(copies drafted one-hot) or a number in [0, {COPY_BOOST_MAX:g}]; fix "
                                     "draft_config.json or the calibration's --copy-boosts")

    @staticmethod
    def make(target_cfg: ModelConfig, boundaries: tuple[int, ...], anchors: tuple[int, ...] | None = None,
             num_layers: int | None = 1, draft_vocab_size: int = 0, fingerprint: str = "",
             frozen_lm_head: bool = True) -> "DraftConfig":
        """A new head's shape; num_layers None means 1 (a trained head's is in its draft_config.json).
        `frozen_lm_head=False` trains (and stores) the head's own LM-head rows instead of reusing the target's."""
        num_layers = 1 if num_layers is None else num_layers
        L = target_cfg.num_layers
        b = validate_boundaries(boundaries, L)
        a = tuple(b) if anchors is None else check_layer_indices(anchors, "anchors", list(b))
        if not a or a[0] != 0 or any(x >= y for x, y in zip(a, a[1:])) or a[-1] > L:
            raise SpdConfigError(
                f"anchors {list(a)} are invalid: they must start at 0, strictly increase and stay <= "
                f"num_layers={L} (default: the stage boundaries {list(b)})")
        if num_layers < 1:
            raise SpdConfigError(f"the draft head needs at least one decoder layer, got num_layers={num_layers}")
        if num_layers > L:  # also keeps a typo (draft_layers=10**6) from allocating until the machine runs out
            raise SpdConfigError(f"the draft head may have at most {L} decoder layers (its target's depth), got "
                                 f"num_layers={num_layers}; a draft head is a small fraction of the target (1-4)")
        V = target_cfg.vocab_size
        size = draft_vocab_size
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= V:
            raise SpdConfigError(f"draft vocabulary size {draft_vocab_size!r} is out of range; use 1..{V} (the "
                                 f"model's vocabulary), or 0 for all of it")
        return DraftConfig(len(b) - 1, b, a, num_layers, draft_vocab_size or target_cfg.vocab_size,
                           target_cfg.model_type, target_cfg.hidden_size, L, target_cfg.vocab_size, fingerprint,
                           bool(frozen_lm_head))

    @property
    def num_types(self) -> int:
        return len(self.anchors)

    def type_of_depth(self, depth: int) -> int:
        c = self.boundaries[depth]
        return max(i for i, b in enumerate(self.anchors) if b <= c)

    def depth_types(self) -> list[int]:
        """t(d) for d = 0..n."""
        return [self.type_of_depth(d) for d in range(self.num_stages + 1)]

    def check_num_stages(self, num_stages: int | None) -> None:
        if num_stages is not None and num_stages != self.num_stages:
            raise DraftMismatchError(
                f"the draft head was trained for num_stages={self.num_stages}, not {num_stages}; pass "
                f"num_stages={self.num_stages}, or draft='random', or train a head for n={num_stages}")

    def check_compatible(self, target_cfg: ModelConfig, fingerprint: str, num_stages: int | None,
                         boundaries: tuple[int, ...] | None) -> None:
        diffs = []
        for name, mine, theirs in [("model_type", self.base_model_type, target_cfg.model_type),
                                   ("hidden_size", self.base_hidden_size, target_cfg.hidden_size),
                                   ("num_layers", self.base_num_layers, target_cfg.num_layers),
                                   ("vocab_size", self.base_vocab_size, target_cfg.vocab_size)]:
            if mine != theirs:
                diffs.append(f"{name}: head {mine} vs model {theirs}")
        if diffs:
            raise DraftMismatchError("the draft head was trained for a different model (" + "; ".join(diffs)
                                     + "); load the model it was trained for (model=<its model>), or train a head "
                                       "for this model with `python -m spd_fast.train`")
        if self.base_fingerprint and fingerprint and self.base_fingerprint != fingerprint:
            raise DraftMismatchError(
                f"the draft head was trained for other weights (fingerprint {self.base_fingerprint} vs model "
                f"{fingerprint}); load the checkpoint it was trained for (model=<its model>; a copy of it in fp32 "
                f"or bf16 matches, one saved in fp16 or quantised does not), or use or train a head for this "
                f"checkpoint")
        self.check_num_stages(num_stages)
        if boundaries is not None and tuple(boundaries) != self.boundaries:
            raise DraftMismatchError(
                f"the draft head was trained for stage boundaries {list(self.boundaries)}, not {list(boundaries)}; "
                "omit boundaries (a trained head brings its own split), or adapt the head to this split with "
                "`python -m spd_fast.train --init HEAD --boundaries ...` (keep its anchors)")

    def at_split(self, boundaries: Sequence[int] | None, name: str, stacklevel: int = 3) -> "DraftConfig":
        """This (shipped) head run at other boundaries of its n: same weights and anchors, the depth types
        follow the new split; warns when the split differs (draft=None with user boundaries), at the frame
        `stacklevel` counts from here (the caller of the public function that asked)."""
        if boundaries is None or tuple(boundaries) == self.boundaries:
            return self
        warnings.warn(f"the shipped draft head {name} was trained for stage boundaries {list(self.boundaries)}; "
                      f"running its weights at {list(boundaries)} (output is still exact; drafts may be accepted "
                      "less often: omit boundaries for the split it was trained at, or adapt it with "
                      "`python -m spd_fast.train --init`)", stacklevel=stacklevel)
        return replace(self, num_stages=len(boundaries) - 1, boundaries=tuple(boundaries))

    def check_requested(self, anchors: Sequence[int] | None, num_layers: int | None) -> None:
        """A trained head brings its own anchors and depth; asking it for others is an error, not ignored."""
        if anchors is not None and tuple(anchors) != self.anchors:
            raise DraftMismatchError(
                f"the draft head was trained for anchors {list(self.anchors)}, not {list(anchors)}; "
                "omit anchors (a trained head brings its own) or use draft='random'")
        if num_layers is not None and num_layers != self.num_layers:
            raise DraftMismatchError(
                f"the draft head has {self.num_layers} decoder layers, not draft_layers={num_layers}; omit "
                "draft_layers (a trained head brings its own) or use draft='random'")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> "DraftConfig":
        d: dict[str, Any] = json.loads(text)
        if not isinstance(d, dict):
            raise TypeError(f"a draft head config is a JSON object, not a {type(d).__name__}")
        if d.get("format_version") != FORMAT_VERSION:
            raise DraftMismatchError(
                f"draft head format version {d.get('format_version')!r} is not supported (expected {FORMAT_VERSION})")
        for k in ("boundaries", "anchors"):  # a string would become a tuple of its characters
            v = d[k]
            if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise TypeError(f"{k} must be a non-empty list of layer indices (integers), got {v!r}")
        d["boundaries"], d["anchors"] = tuple(d["boundaries"]), tuple(d["anchors"])
        b, a = d["boundaries"], d["anchors"]
        last = d.get("base_num_layers")
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])) or \
                (isinstance(last, int) and last > 0 and b[-1] != last):  # 0: a head saved without it
            end = f" and end at {last} (base_num_layers)" if isinstance(last, int) and last > 0 else ""
            raise TypeError(f"boundaries {list(b)} must start at 0, strictly increase{end}")
        if a[0] != 0 or any(x >= y for x, y in zip(a, a[1:])) or a[-1] > b[-1]:
            raise TypeError(f"anchors {list(a)} must start at 0, strictly increase and be <= {b[-1]} (the last "
                            f"boundary)")
        if not isinstance(d.get("weights", WEIGHTS_FILE), str):
            raise TypeError(f"'weights' must be a file name, got {d['weights']!r}")
        if d.get("num_stages") != len(d["boundaries"]) - 1:
            raise TypeError(f"num_stages {d.get('num_stages')!r} disagrees with boundaries {list(d['boundaries'])}")
        for k in ("num_layers", "draft_vocab_size", "base_hidden_size", "base_num_layers", "base_vocab_size"):
            if k in d and (not isinstance(d[k], int) or isinstance(d[k], bool)):
                raise TypeError(f"{k} must be an integer, got {d[k]!r}")
        if isinstance(d.get("num_layers"), int) and isinstance(d.get("base_num_layers"), int) and \
                not 1 <= d["num_layers"] <= d["base_num_layers"]:
            raise TypeError(f"num_layers must lie in 1..{d['base_num_layers']} (the target's depth), got "
                            f"{d['num_layers']}")
        if isinstance(d.get("draft_vocab_size"), int):  # a bad size failed later in torch (a negative dimension)
            top = d.get("base_vocab_size")  # or allocated a multi-GB LM head before the size check
            if d["draft_vocab_size"] < 1 or (isinstance(top, int) and top > 0 and d["draft_vocab_size"] > top):
                room = f"1..{top} (base_vocab_size)" if isinstance(top, int) and top > 0 else ">= 1"
                raise TypeError(f"draft_vocab_size must lie in {room}, got {d['draft_vocab_size']}")
        if not isinstance(d.get("frozen_lm_head", True), bool):
            raise TypeError(f"frozen_lm_head must be true or false, got {d['frozen_lm_head']!r}")
        return DraftConfig(**d)


class DraftHead(nn.Module):
    """The PDM. `norm` is the target's final norm (shared and frozen, never saved with the head)."""

    def __init__(self, dcfg: DraftConfig, target_cfg: ModelConfig, target_norm: RMSNorm | None = None):
        super().__init__()
        H = target_cfg.hidden_size
        self.dcfg, self.tcfg = dcfg, target_cfg
        self.proj = nn.ModuleList(nn.Linear((i + 1) * H, H, bias=False) for i in range(dcfg.num_types))
        self.layers = nn.ModuleList(DecoderLayer(target_cfg) for _ in range(dcfg.num_layers))
        self.lm_head = Linear(H, dcfg.draft_vocab_size, bias=False)  # packable (packed.pack_draft)
        self.register_buffer("draft_vocab", torch.arange(dcfg.draft_vocab_size), persistent=True)
        # Kept out of the module tree so state_dict() and parameters() never include the target's norm.
        self.__dict__["norm"] = target_norm if target_norm is not None else RMSNorm(H, target_cfg.rms_norm_eps)
        self.max_len = 0

    # ---- aggregation -------------------------------------------------------------------------
    def padded_proj(self) -> torch.Tensor:
        """[m, H, m*H]: W_i zero-padded to the full anchor width so rows of mixed types are one bmm."""
        cached = self.__dict__.get("_padded")
        if cached is not None and not self.training and not torch.is_grad_enabled():
            return cached
        m, H = self.dcfg.num_types, self.tcfg.hidden_size
        w = self.proj[0].weight.new_zeros(m, H, m * H)
        for i, p in enumerate(self.proj):
            w[i, :, : (i + 1) * H] = p.weight
        # inference reuses it (weights are frozen there); training rebuilds it every call
        self.__dict__["_padded"] = None if self.training else w.detach()
        return w

    def aggregate(self, anchor_rows: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """anchor_rows [R, m, H] (anchors beyond a row's type are ignored), types [R] -> g [R, H]."""
        from .ops import aggregate

        packed = self.__dict__.get("_packed_proj")  # set by packed.pack_draft (CPU decode rows)
        if (packed is not None and anchor_rows.dtype == torch.float32 and anchor_rows.device.type == "cpu"
                and anchor_rows.shape[0] <= PACKED_MAX_ROWS and not torch.is_grad_enabled()):
            from .packed import aggregate_packed

            return aggregate_packed(anchor_rows, types, packed)
        return aggregate(anchor_rows, types, self.padded_proj())

    # ---- inference ---------------------------------------------------------------------------
    def setup_cache(self, max_len: int) -> None:
        shape = (1, self.tcfg.num_kv_heads, max_len + 1, self.tcfg.head_dim)
        p = self.lm_head.weight
        with torch.inference_mode(False):  # normal tensors, as in Transformer.setup_caches
            for layer in self.layers:
                layer.attn.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
                layer.attn.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
            cos, sin = rope_tables(self.tcfg, max_len + 1)
            self.rope_cos, self.rope_sin = cos.to(p.device), sin.to(p.device)
        self.max_len = max_len

    def rope_cos_train(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [R, D] for training (no cache needed)."""
        n = int(positions.max()) + 1
        if getattr(self, "_train_rope_len", 0) < n or self._train_cos.device != positions.device:
            cos, sin = rope_tables(self.tcfg, max(n, 512))
            self._train_cos, self._train_sin = cos.to(positions.device), sin.to(positions.device)
            self._train_rope_len = max(n, 512)
        return self._train_cos[positions], self._train_sin[positions]

    def tower(self, g: torch.Tensor, positions: torch.Tensor, kv_bound: int) -> torch.Tensor:
        """g [B, R, H] at `positions` [B, R] through the decoder layers (writes their K/V)."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        mask = attention_mask(positions, kv_bound)
        for layer in self.layers:
            g = layer(g, positions, cos, sin, kv_bound, mask)
        return g

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write draft.safetensors + draft_config.json. A frozen LM head is not stored: it is
        rebuilt from the target's LM head and `draft_vocab` at load."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        sd = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
              for k, v in self.state_dict().items()
              if not (self.dcfg.frozen_lm_head and k == "lm_head.weight")}
        # each file through a temporary name and a rename: a run killed mid-save leaves the previous head whole
        # (training rewrites OUT/head and OUT/best_head in place)
        save_file(sd, str(path / (WEIGHTS_FILE + ".tmp")))
        replace_durably(path / (WEIGHTS_FILE + ".tmp"), path / WEIGHTS_FILE)
        write_text_durably(path / "draft_config.json", replace(self.dcfg, weights=WEIGHTS_FILE).to_json())


def init_from_target(head: DraftHead, target, seed: int = 0) -> DraftHead:
    """Seeded initialisation: tower like a fresh transformer, LM head rows copied from the target."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(1.0)
        for i, proj in enumerate(head.proj):
            # start as the mean of the available anchors so the feature has a sensible scale
            H = head.tcfg.hidden_size
            eye = torch.eye(H) / (i + 1)
            proj.weight.copy_(torch.cat([eye] * (i + 1), dim=1) + 0.01 * torch.randn(proj.weight.shape, generator=g))
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_vocab].to(head.lm_head.weight.dtype))
    return head


def random_draft_head(target, dcfg: "DraftConfig", seed: int = 0) -> DraftHead:
    """An untrained head for inference (`draft="random"`, or no shipped head): seeded, on the target's device and
    in its dtype, frozen."""
    head = init_from_target(DraftHead(dcfg, target.cfg, target.norm), target, seed)
    return head.to(device=target.embed.weight.device, dtype=target.embed.weight.dtype).eval().requires_grad_(False)


def set_draft_vocab(head: DraftHead, token_ids: torch.Tensor, target) -> None:
    """Point the head at a draft vocabulary (index -> token id) and copy the target's LM-head rows."""
    with torch.no_grad():
        head.draft_vocab.copy_(token_ids.to(head.draft_vocab))
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_vocab].to(head.lm_head.weight.dtype))


_RUN_HEADS = {"best_head": "the best on validation", "head": "the last checkpoint"}  # in a training run's --out


def check_draft_stages(draft: str | os.PathLike | None, num_stages: Sequence[int]) -> None:
    """A head directory given for runs at several n (eval, bench) fits every one of them: checked before the first
    run, not after it (None, the shipped head per n, and "random" fit any n)."""
    if draft is None or draft == "random":
        return
    dcfg = read_draft_config(draft)
    for n in num_stages:
        dcfg.check_num_stages(n)


def read_draft_config(path: str | Path) -> DraftConfig:
    """The DraftConfig of a head directory, with a clear error when it is not one."""
    path = Path(path)
    cfg_file = path / "draft_config.json"
    if not path.exists():
        raise DraftMismatchError(f"draft head {path} does not exist; pass a head directory (draft_config.json + "
                                 "draft.safetensors), draft='random', or draft=None for the shipped head")
    runs = [d for d in _RUN_HEADS if (path / d / "draft_config.json").is_file()]
    not_a_head = DraftMismatchError(
        f"{path} is not a draft head checkpoint (expected draft_config.json and draft.safetensors in it)"
        + ("; it holds a training run: pass " + " or ".join(f"{path}/{d} ({_RUN_HEADS[d]})" for d in runs)
           if runs else ""))
    if not cfg_file.is_file():
        raise not_a_head
    try:
        dcfg = DraftConfig.from_json(cfg_file.read_text(encoding="utf-8"))
    except DraftMismatchError:
        raise
    except OSError as e:  # unreadable (permissions) or gone since the check above
        raise DraftMismatchError(f"cannot read {cfg_file} ({type(e).__name__}: {e.strerror or e}); check its "
                                 "permissions") from None
    except RecursionError:  # JSON nested past Python's limit
        raise DraftMismatchError(f"{cfg_file} is not a valid draft head config (JSON nested too deeply); re-save "
                                 "the head or point draft= at another one") from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # ValueError: bad JSON or not UTF-8
        raise DraftMismatchError(f"{cfg_file} is not a valid draft head config ({type(e).__name__}: {e}); "
                                 "re-save the head or point draft= at another one") from e
    if not (path / dcfg.weights).is_file():
        if dcfg.weights == WEIGHTS_FILE:
            raise not_a_head
        raise DraftMismatchError(f"{path}: the weights file {dcfg.weights!r} that its draft_config.json names "
                                 f"(relative to the head directory) does not exist; fix 'weights' there or "
                                 f"put the file back")
    return dcfg


def head_digest(path: str | Path) -> str:
    """The first 16 hex digits of a SHA-256 over a head directory's draft_config.json and its weights file:
    which head (weights and calibration) a result came from, whatever the directory is called."""
    import hashlib

    path = Path(path)
    h = hashlib.sha256((path / "draft_config.json").read_bytes())
    with open(path / read_draft_config(path).weights, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def load_draft(path: str | Path, target, fingerprint: str,
               num_stages: int | None = None, boundaries: tuple[int, ...] | None = None,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DraftHead:
    from safetensors.torch import load_file

    path = Path(path)
    dcfg = read_draft_config(path)
    w_file = path / dcfg.weights
    target_cfg = target.cfg
    dcfg.check_compatible(target_cfg, fingerprint, num_stages, boundaries)
    try:
        sd = load_file(str(w_file))
    except Exception as e:
        raise DraftMismatchError(f"cannot read {w_file} ({e}); the file is truncated or corrupt") from e
    dv_file = sd.get("draft_vocab")
    if dv_file is not None and (dv_file.dtype.is_floating_point or dv_file.dtype == torch.bool):
        # load_state_dict would cast it into the int64 buffer (0.7 -> 0) without a word
        raise DraftMismatchError(f"{w_file}: its draft_vocab holds {dv_file.dtype} values, not integer token ids; "
                                 f"re-save the head")
    head = DraftHead(dcfg, target_cfg, target.norm)
    try:
        missing, unexpected = head.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # a tensor of another shape than the config says
        raise DraftMismatchError(f"{w_file} does not match its config ({str(e).splitlines()[-1].strip()}); "
                                 f"re-save the head") from None
    dv = head.draft_vocab
    if (dv.numel() != dcfg.draft_vocab_size or int(dv.min()) < 0
            or int(dv.max()) >= target_cfg.vocab_size or int(dv.unique().numel()) != dv.numel()):
        raise DraftMismatchError(f"{w_file}: its draft_vocab must hold {dcfg.draft_vocab_size} distinct token ids of "
                                 f"the model (0..{target_cfg.vocab_size - 1}); re-save the head")
    if dcfg.frozen_lm_head and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight[head.draft_vocab].float())
    if missing or unexpected:
        raise DraftMismatchError(f"{w_file} does not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    head.digest = head_digest(path)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
