"""`load_distributed()` and `DistributedEngine`: placement="distributed", one pipeline stage per rank.

Every rank of the job runs the same code (SPMD): `load_distributed(...)` on every rank joins the
process group, checks that all ranks hold the same checkpoint and options, lets rank 0 choose the
draft head and stage split, then loads only this rank's layers. `generate(...)` on every rank runs
the requests: rank 0 returns the outputs, the other ranks serve their stage and return None.
"""
from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from ..api import _plain_numbers  # the api imports this package lazily: no cycle
from ..config import (DEFAULT_LOOKUP, ModelConfig, RandomHeadWarning, SpdConfigError, check_layer_indices,
                      check_head_seed, check_lookup, check_seed, check_stage_count, uniform_boundaries,
                      validate_boundaries, validate_num_stages)
from ..pdm import DraftConfig, DraftHead, DraftMismatchError, init_from_target, load_draft, read_draft_config
from ..runtime import Prompt, Target, _eos_ids, parse_dtype
from ..sampling import SamplingParams, make_generator
from ..store import resolve_model_dir
from .comm import Links, RankFailure
from .executor import PipelineDriver, StagePlan, StageWorker
from .launch import (DistributedConfigError, RankContext, broadcast_from_rank0, check_same, gather_or_fail,
                     hostname, init_rank)
from .partial_load import checkpoint_probe, full_weights_fingerprint, load_stage


@dataclass(frozen=True)
class Request:
    """One request of a distributed job: prompt token ids, new-token budget, sampling settings, extra stop ids."""
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    params: SamplingParams
    eos_ids: tuple[int, ...]


def _describe_rank(path: str, dtype: torch.dtype, max_len: int, requested_n: int, boundaries) -> dict[str, Any]:
    cfg = ModelConfig.from_dir(path)
    return {"host": hostname(), "path": str(path), "checkpoint": checkpoint_probe(path, cfg), "dtype": str(dtype),
            "max_len": max_len, "num_stages": requested_n, "boundaries": boundaries}


def _plan_on_rank0(path: str, cfg: ModelConfig, dtype: torch.dtype, n: int, boundaries, anchors, draft,
                   draft_layers: int | None, draft_vocab_size: int) -> dict[str, Any]:
    """Rank 0 picks the draft head (which may fix the stage split) and the anchors."""
    from ..api import shipped_head  # the api imports this package lazily; no cycle at import time

    fp = full_weights_fingerprint(path, cfg)
    b = validate_boundaries(tuple(boundaries), cfg.num_layers) if boundaries is not None else \
        uniform_boundaries(cfg.num_layers, n)
    source = str(draft)
    if draft is None:
        found = shipped_head(SimpleNamespace(fingerprint=fp), n)  # type: ignore[arg-type]
        if found is None:
            warnings.warn(f"no shipped draft head for this model at num_stages={n}; using a random head "
                          "(output is still exact, but few drafts will be accepted)", RandomHeadWarning, stacklevel=3)
            draft = "random"
        else:
            draft, source = str(found), f"shipped:{found.name}"
    if draft == "random":
        dcfg = DraftConfig.make(cfg, b, anchors, draft_layers, draft_vocab_size, fingerprint=fp)
        source = "random"
    else:
        dcfg = read_draft_config(draft)  # a missing or malformed config: the same error as api.load's
        shipped = source.startswith("shipped:")  # as in api.load: the shipped head runs at any split of its n
        if dcfg.num_stages != n:  # --num-stages must equal the world size here, so the fix is the rank count
            dcfg.check_compatible(cfg, fp, None, None)  # another model or other weights: that error first
            raise DraftMismatchError(
                f"the draft head was trained for num_stages={dcfg.num_stages}, and placement='distributed' runs one "
                f"stage per rank on {n} ranks; start {dcfg.num_stages} processes (torchrun --nproc-per-node "
                f"{dcfg.num_stages}), or use draft='random', or train a head for n={n}")
        dcfg.check_compatible(cfg, fp, n, tuple(boundaries) if boundaries is not None and not shipped else None)
        dcfg.check_requested(anchors, draft_layers)
        if draft_vocab_size and draft_vocab_size != dcfg.draft_vocab_size:  # 0: the default, any head's own
            raise SpdConfigError(f"the draft head has a {dcfg.draft_vocab_size}-token draft vocabulary, not "
                                 f"draft_vocab_size={draft_vocab_size}; omit draft_vocab_size (a trained head brings "
                                 "its own) or use draft='random'")
        if shipped:
            dcfg = dcfg.at_split(b if boundaries is not None else None, Path(draft).name)
    return {"boundaries": tuple(dcfg.boundaries), "anchors": tuple(dcfg.anchors), "draft": str(draft),
            "draft_source": source, "fingerprint": fp, "dcfg": dcfg.to_json()}


class DistributedEngine:
    """One pipeline stage per rank. `generate` returns outputs on rank 0 and None on the others."""

    def __init__(self, ctx: RankContext, plan: StagePlan, draft_source: str, target: Target | None,
                 driver: PipelineDriver | None, worker: StageWorker | None, links: Links | None):
        self.ctx, self.plan, self.draft_source = ctx, plan, draft_source
        self.num_stages = plan.n
        self.boundaries = plan.boundaries
        self.target, self.driver, self.worker, self.links = target, driver, worker, links
        self.last_rank_stats: dict[int, list[float]] = {}
        # rank 0: one call at a time (the ranks serve calls in order), as Engine.generate holds the model's decode
        # lock; and once a call is cut off after its first message the ranks are out of step for good
        self._lock = threading.RLock()
        self._broken: str | None = None

    def _talk(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), which messages the other ranks; anything that cuts it off (an error, a KeyboardInterrupt)
        leaves their queues out of step with rank 0, so this engine refuses every later call."""
        if self._broken is not None:
            raise RankFailure(f"rank 0: this distributed engine is out of step with the other ranks since a call "
                              f"was cut off ({self._broken}); restart the job (torchrun) to decode again")
        try:
            return fn(*args)
        except BaseException as e:
            if self.num_stages > 1:
                self._broken = f"{type(e).__name__}: {e}"
            raise

    @property
    def is_driver(self) -> bool:
        return self.ctx.rank == 0

    @_plain_numbers
    def generate(self, prompt: Prompt | Sequence[Prompt], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, method: str = "spd",
                 eos_ids: Sequence[int] = (), stop: Any = None,
                 sampling_params: SamplingParams | None = None) -> Any:
        """Call on EVERY rank. Rank 0: GenerationOutput (or a list for a list of prompts); others: None.
        eos_ids adds stop tokens to the model's own; stop strings are not supported here (refused).
        sampling_params: a SamplingParams in place of temperature, top_k, top_p and seed (as Engine.generate)."""
        if not self.is_driver:
            self.worker.serve_call()  # type: ignore[union-attr]
            return None
        with self._lock:
            return self._generate(prompt, max_new_tokens, temperature, top_k, top_p, seed, method, eos_ids, stop)

    def _generate(self, prompt: Any, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                  seed: int | None, method: str, eos_ids: Sequence[int], stop: Any) -> Any:
        from ..api import _as_batch, check_stop
        from ..ar import check_eos_ids

        try:  # validate everything before the first message, so a bad input cannot strand the others
            if method != "spd":
                raise SpdConfigError(f"placement='distributed' runs method='spd' only, got {method!r}")
            check_stop(stop, "distributed")
            params = SamplingParams(temperature, top_k, top_p, seed)
            prompts, single = _as_batch(prompt)
            eos = tuple(self.target.eos_ids) + check_eos_ids(eos_ids, self.target.cfg.vocab_size)
            reqs = [Request(tuple(self.target.encode(p)), max_new_tokens, params, eos) for p in prompts]
        except Exception:
            self._talk(self.driver.end_call)  # type: ignore[union-attr]
            raise
        outs = self.run_requests(reqs)
        return outs[0] if single else outs

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a distributed engine returns whole outputs on rank 0 (`generate`)."""
        raise SpdConfigError("placement='distributed' does not stream: use generate(), which returns the whole output "
                             "on rank 0, or a single-process engine for stream()")

    def run_requests(self, reqs: Sequence[Request]) -> Any:
        """Token-id requests (call on every rank; rank 0's list is the one that counts)."""
        from ..ar import check_capacity, check_context, check_eos_ids, check_max_new_tokens, check_prompt_ids

        if not self.is_driver:
            self.worker.serve_call()  # type: ignore[union-attr]
            return None
        with self._lock:
            drv, vocab = self.driver, self.target.cfg.vocab_size
            try:  # every request is checked before the first is sent, so a bad one cannot strand the others
                for r in reqs:
                    check_prompt_ids(r.prompt_ids, vocab)
                    check_max_new_tokens(r.max_new_tokens)
                    check_eos_ids(r.eos_ids, vocab)
                    check_capacity(drv.model, len(r.prompt_ids), r.max_new_tokens, extra=self.num_stages + 1)
                    check_context(self.target.cfg.max_position_embeddings, len(r.prompt_ids), r.max_new_tokens)
            except Exception:
                self._talk(drv.end_call)
                raise
            return self._talk(self._decode, reqs)

    def _decode(self, reqs: Sequence[Request]) -> list:
        from ..api import GenerationOutput

        drv, outs = self.driver, []
        for r in reqs:
            gen = make_generator(r.params, self.ctx.device)
            res = drv.run(list(r.prompt_ids), r.max_new_tokens, r.params, r.eos_ids, gen)
            res.metrics["num_stages"] = float(self.num_stages)
            outs.append(GenerationOutput(self.target.decode(res.token_ids), res.token_ids, len(r.prompt_ids),
                                         res.finished_by_eos, res.metrics, "eos" if res.finished_by_eos else "length"))
        self.last_rank_stats = drv.end_call()
        return outs


def load_distributed(model: str | os.PathLike | None = None, draft: str | os.PathLike | None = None,
                     num_stages: int | None = None, boundaries: Sequence[int] | None = None,
                     anchors: Sequence[int] | None = None, draft_layers: int | None = None,
                     dtype: str | torch.dtype = "float32",
                     device: str = "cpu", max_len: int = 2048, seed: int = 0, progress: bool = True,
                     timeout: float = 30.0, startup_timeout: float = 60.0,
                     draft_vocab_size: int = 0, lookup: int = DEFAULT_LOOKUP,
                     startup_check: Callable[[], None] | None = None) -> DistributedEngine:
    """Call on every rank of a torchrun job. num_stages defaults to the world size and must equal it.
    `startup_check` runs on every rank once all have joined; if it raises on any rank, every rank gets
    that error (e.g. the CLI's check of rank 0's output path), instead of the others waiting for a rank
    that left."""
    check_lookup(lookup)
    check_seed(seed, "seed (of a random head)")
    tdtype = parse_dtype(dtype)
    if not isinstance(max_len, int) or max_len < 8:
        raise SpdConfigError(f"max_len must be an integer >= 8, got {max_len!r}")
    if boundaries is not None:  # the checks load() makes that need no checkpoint, before any rank waits
        boundaries = check_layer_indices(boundaries, "stage boundaries", [0, 15, 30])
        if len(boundaries) < 2:
            raise SpdConfigError(f"stage boundaries {list(boundaries)} need at least two entries (0 and the number "
                                 f"of layers), e.g. [0, 15, 30]")
        check_stage_count(num_stages, boundaries)
    ctx = init_rank(device, timeout, startup_timeout)
    W = ctx.world_size
    requested = len(boundaries) - 1 if boundaries is not None else (W if num_stages is None else num_stages)
    bnd = tuple(int(x) for x in boundaries) if boundaries is not None else None

    def resolve() -> str:  # the first rank of each node converts the default GGUF once; the others reuse it
        return str(resolve_model_dir(model, progress=progress and ctx.rank == 0))

    if startup_check is not None:
        gather_or_fail(ctx, "checking the options", startup_check)
    first = gather_or_fail(ctx, "resolving the model", resolve if ctx.local_rank == 0 else (lambda: None))
    descs = gather_or_fail(ctx, "reading the checkpoint", lambda: _describe_rank(
        first[ctx.rank] or resolve(), tdtype, max_len, requested, bnd))
    path = descs[ctx.rank]["path"]
    check_same(descs, ("checkpoint",), "ranks hold different checkpoints",
               "every rank must load the same model (same files on every node)")
    check_same(descs, ("dtype", "max_len", "num_stages", "boundaries"), "ranks were started with different options",
               "start every rank with the same arguments")
    if requested != W:
        raise DistributedConfigError(
            f"this job has world size {W} but num_stages={requested}: placement='distributed' runs one stage per "
            f"rank; start {requested} processes (torchrun --nproc-per-node {requested}) or use num_stages={W}")
    cfg = ModelConfig.from_dir(path)
    validate_num_stages(cfg.num_layers, W)
    info = broadcast_from_rank0(ctx, "choosing the draft head", lambda: _plan_on_rank0(
        path, cfg, tdtype, W, bnd, anchors, draft, draft_layers, draft_vocab_size))
    check_head_seed(seed, info["draft_source"])  # every rank holds the same info: all refuse it at once
    plan = StagePlan(info["boundaries"], info["anchors"])

    def build() -> tuple:
        s, n = ctx.rank, plan.n
        net = load_stage(path, cfg, plan.layers(s), embedding=s == 0, head=s == 0 or s == n - 1,
                         dtype=tdtype, device=ctx.device, max_len=max_len)
        links = Links(s, ctx.timeout, plan.describe, ctx.device, n) if n > 1 else None
        if s != 0:
            return None, None, StageWorker(s, plan, net, links, tdtype), links
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        target = Target(net, tok, Path(path), _eos_ids(Path(path), cfg, tok), info["fingerprint"])
        if info["draft_source"] == "random":
            head = DraftHead(DraftConfig.from_json(info["dcfg"]), cfg, net.norm)
            head = init_from_target(head, net, seed).to(tdtype).eval().requires_grad_(False)
        else:
            shipped = info["draft_source"].startswith("shipped:")  # rank 0 already warned if its split differs
            head = load_draft(info["draft"], net, info["fingerprint"], n, None if shipped else plan.boundaries, tdtype,
                              ctx.device)
            if shipped:
                head.dcfg = DraftConfig.from_json(info["dcfg"])  # rank 0's plan: the split this run uses
        from ..packed import pack_draft

        pack_draft(head, net)  # as in api.load: a CPU head on a packed target decodes from packed weights
        return target, PipelineDriver(plan, net, head, links, lookup), None, links

    box: dict[str, tuple] = {}  # the built objects stay local; the gather only exchanges success / errors
    gather_or_fail(ctx, "loading the stages", lambda: box.setdefault("parts", build()) and None)
    target, driver, worker, links = box["parts"]
    return DistributedEngine(ctx, plan, info["draft_source"], target, driver, worker, links)
