"""Calibrate a trained head's draft temperature for sampled decoding.

With one draft per position, a draft drawn from q is accepted with probability sum_x min(p(x), q(x)),
p the target's distribution at temperature T. A head trained with a KL loss is usually less sure
than the target (it sees less of the context), so its softmax at T is flatter than p and drafting
at a lower temperature T * s (s < 1) raises that overlap. Output stays exact for any s: verification
uses the q the draft was drawn from.

`calibrate()` estimates the expected acceptance teacher-forced on held-out samples at full fill
(the pipeline's steady state) for a grid of scales and temperatures; `python -m
spd_fast.train.calibrate HEAD --val FILE --write` stores the best common scale in the head's
draft_config.json (`draft_temperature_scale`), which PdmDrafter applies at every temperature > 0.

The same pass calibrates the context-lookup gate (`lookup_gate_confidence`, `lookup_gate_ratio`): on
every row where a match of the k newest tokens proposes a copy, it records the PDM's top probability,
the copied token's PDM probability and which of the two is the target's greedy token, and picks the
gate with the highest greedy draft accuracy over all rows (the no-gate default wins ties). For sampled
decoding it then fits `lookup_copy_boost` on the same rows: at the chosen scale, the expected acceptance
(mean over the temperatures) of drafting each match from the PDM's q with the copied token's logit raised
by d, against today's gated one-hot copy, which wins ties (`copy_boost_table`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import torch

DEFAULT_SCALES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.15)
DEFAULT_TEMPERATURES = (0.7, 1.0)
DEFAULT_GATE_CONFIDENCES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
DEFAULT_GATE_RATIOS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
DEFAULT_COPY_BOOSTS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0)


def lookup_gate_table(fired: Sequence[tuple[float, float, bool, bool, bool]], rows: int, pdm_right: int,
                      confidences: Sequence[float], ratios: Sequence[float]) -> dict:
    """Greedy draft accuracy of each lookup gate. fired: one (PDM top probability, copied token's PDM
    probability, copy inside the draft vocabulary, copy right, PDM right) per row where the lookup matched;
    rows / pdm_right: all rows and those the PDM alone gets right. The rule is pdm.gate_keeps_pdm, as in drafters.PdmDrafter.copy_allowed."""
    from ..pdm import NO_LOOKUP_GATE, gate_keeps_pdm

    def accuracy(conf: float, ratio: float) -> float:
        right = pdm_right
        for top, p_copy, inside, copy_ok, pdm_ok in fired:
            if not gate_keeps_pdm(top, p_copy, inside, conf, ratio):  # the copy is drafted
                right += int(copy_ok) - int(pdm_ok)
        return right / max(rows, 1)

    grid = {f"{c},{r}": accuracy(c, r) for c in confidences for r in ratios}
    best, best_acc = NO_LOOKUP_GATE, accuracy(*NO_LOOKUP_GATE)
    for c in confidences:
        for r in ratios:
            if grid[f"{c},{r}"] > best_acc + 1e-12:
                best, best_acc = (c, r), grid[f"{c},{r}"]
    return {"rows": rows, "rows_matched": len(fired), "pdm_alone": pdm_right / max(rows, 1),
            "no_gate": accuracy(*NO_LOOKUP_GATE), "grid": grid, "best": list(best), "best_accuracy": best_acc}


def copy_boost_table(rows: int, base: dict, copies: dict, gate: Sequence[float], temperatures: Sequence[float],
                     boosts: Sequence[float]) -> dict:
    """Expected acceptance at T > 0 with and without the copy boost, at one draft temperature scale.

    base: {T: sum over all rows of the PDM's overlap sum_x min(p_T, q_T)}; copies: per matched row,
    tensors "base" [r, len(T)] (the PDM's overlap), "one_hot" [r, len(T)] (p_T of the copied token),
    "boost" [r, len(T), len(boosts)] (the overlap of the boosted q), "inside" [r] (copy in the draft
    vocabulary), "top" / "p_copy" [r] (what the gate reads). Copies outside the draft vocabulary are
    drafted one-hot by both drafters (the gate always lets them through), as in drafters.PdmDrafter."""
    from ..pdm import gate_keeps_pdm

    n = max(rows, 1)
    copy = ~gate_keeps_pdm(copies["top"], copies["p_copy"], copies["inside"], gate[0], gate[1])  # one-hot copies
    one_hot_gain = torch.where(copy[:, None], copies["one_hot"] - copies["base"], 0.0)  # [r, T]
    one_hot = {str(t): (base[t] + float(one_hot_gain[:, i].sum())) / n for i, t in enumerate(temperatures)}
    outside = ~copies["inside"]
    grid = {}
    for j, d in enumerate(boosts):
        gain = torch.where(copies["inside"][:, None], copies["boost"][:, :, j] - copies["base"],
                           torch.where(outside[:, None], one_hot_gain, 0.0))
        grid[str(d)] = {str(t): (base[t] + float(gain[:, i].sum())) / n for i, t in enumerate(temperatures)}

    def mean(acc: dict) -> float:
        return sum(acc.values()) / max(len(acc), 1)

    best, best_mean = None, mean(one_hot)
    for d in boosts:
        if mean(grid[str(d)]) > best_mean + 1e-12:
            best, best_mean = d, mean(grid[str(d)])
    return {"rows_matched": int(copies["top"].numel()), "one_hot": one_hot, "one_hot_mean": mean(one_hot),
            "grid": grid, "best": best, "best_mean": best_mean}


def teacher_rows(target_obj, head, samples: Sequence[dict], batch_size: int = 8, max_seq_len: int = 512):
    """Yield (ids [B, T], sel, student logits [rows, V_d], target logits [rows, V]) batch by batch, both
    float32: sel holds the flat indices b * T + r of the assistant rows, each scored as the newest token
    at full fill (the pipeline's steady state). Frees the target's caches at the end."""
    from .trainer import PdmTrainer, TrainConfig, collate

    head.eval()
    tr = PdmTrainer(target_obj.model, head, TrainConfig(max_seq_len=max_seq_len))
    try:
        with torch.no_grad():
            for i in range(0, len(samples), batch_size):
                ids, lens, loss_mask = collate(list(samples[i:i + batch_size]), max_seq_len)
                anchors, logits = tr.teacher_forward(ids, lens)
                sel = loss_mask.reshape(-1).nonzero().squeeze(1)
                if sel.numel() == 0:
                    continue
                s_logits, _ = tr.student_logits(anchors, lens, None, sel)
                yield ids, sel, s_logits.float(), logits.float().reshape(-1, logits.shape[-1])[sel]
    finally:
        target_obj.model.free_caches()


def lookup_matches(ids: torch.Tensor, sel: torch.Tensor, k: int):
    """Yield (row, copied token id) for the rows of `sel` (flat b * T + r) whose k newest tokens
    ids[b, r-k+1 .. r] occurred earlier in ids[b, :r+1]: what the drafter's context lookup copies."""
    from ..ops import lookup_next

    T = ids.shape[1]
    for row, flat in enumerate(sel.tolist()):
        b, r = divmod(flat, T)
        if r >= k:
            found, copied = lookup_next(ids[b, :r + 1], torch.tensor(r), k)
            if bool(found):
                yield row, int(copied)


@torch.no_grad()
def calibrate(target_obj, head, samples: Sequence[dict], temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
              scales: Sequence[float] = DEFAULT_SCALES, batch_size: int = 8, max_seq_len: int = 512,
              lookup: int = 0, gate_confidences: Sequence[float] = DEFAULT_GATE_CONFIDENCES,
              gate_ratios: Sequence[float] = DEFAULT_GATE_RATIOS,
              copy_boosts: Sequence[float] = DEFAULT_COPY_BOOSTS) -> dict:
    """-> {"rows", "top1", "acceptance": {"T": {"s": expected acceptance}}, "mean": {"s": mean over T},
    "best_scale"}, plus "lookup_gate" (lookup_gate_table) and "copy_boost" (copy_boost_table, at the best
    scale and gate) when lookup = k > 0. Rows: the assistant positions of `samples`, each scored as the
    newest token."""
    from ..config import SpdConfigError, check_lookup
    from ..pdm import COPY_BOOST_MAX, SCALE_RANGE, draft_vocab_slots, valid_boost, valid_fraction, valid_scale

    if not samples:
        raise SpdConfigError("calibration needs held-out samples; pass --val FILE (chat jsonl or text)")
    for x in temperatures:
        if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0):
            raise SpdConfigError(f"temperatures must be positive numbers, got {x!r}")
    for x in scales:
        if not valid_scale(x):
            raise SpdConfigError(f"scales must be numbers in [{SCALE_RANGE[0]}, {SCALE_RANGE[1]}], got {x!r}")
    check_lookup(lookup)
    for x in list(gate_confidences) + list(gate_ratios):
        if not valid_fraction(x):
            raise SpdConfigError(f"lookup gate confidences and ratios must be numbers in [0, 1], got {x!r}")
    for x in copy_boosts:
        if x is None or not valid_boost(x):
            raise SpdConfigError(f"copy boosts must be numbers in [0, {COPY_BOOST_MAX:g}], got {x!r}")
    temperatures, scales, gate_confidences, gate_ratios, copy_boosts = (
        _unique(v) for v in (temperatures, scales, gate_confidences, gate_ratios, copy_boosts))
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("base", "one_hot", "boost")}
    fired: list[tuple[float, float, bool, bool, bool]] = []
    pdm_right = 0
    dv = head.draft_vocab
    slot = None
    sums = {(t, s): 0.0 for t in temperatures for s in scales}
    rows = agree = 0.0
    for ids, sel, s_logits, t_logits in teacher_rows(target_obj, head, samples, batch_size, max_seq_len):
        rows += sel.numel()
        y = t_logits.argmax(-1)
        right = dv[s_logits.argmax(-1)] == y
        agree += float(right.sum())
        if lookup:
            pdm_right += int(right.sum())
            q = torch.cat([torch.softmax(s_logits, -1), s_logits.new_zeros(len(s_logits), 1)], 1)  # col V_d: 0
            slot = draft_vocab_slots(dv, t_logits.shape[-1]).cpu() if slot is None else slot
            matches = list(lookup_matches(ids, sel, lookup))
            for row, c in matches:
                fired.append((float(q[row].max()), float(q[row, slot[c]]), int(slot[c]) < len(dv), c == int(y[row]),
                              bool(right[row])))
            if matches and copy_boosts:
                _copy_rows(parts, matches, slot, s_logits, t_logits, dv, temperatures, scales, copy_boosts)
        for t in temperatures:
            p_dv = torch.softmax(t_logits / t, -1)[:, dv]  # the draft has no mass outside V_d
            for s in scales:
                sums[(t, s)] += float(torch.minimum(p_dv, torch.softmax(s_logits / (t * s), -1)).sum())
    if not rows:  # every figure below would be 0 and the first grid value "best": nothing to write
        raise SpdConfigError(f"none of the {len(samples)} --val samples has an answer token within the first "
                             f"{max_seq_len} tokens (a longer prompt leaves its answer out); pass held-out samples "
                             f"with answers and shorter prompts")
    acc = {str(t): {str(s): sums[(t, s)] / rows for s in scales} for t in temperatures}
    mean = {str(s): sum(acc[str(t)][str(s)] for t in temperatures) / len(temperatures) for s in scales}
    best = max(scales, key=lambda s: mean[str(s)])
    res = {"rows": int(rows), "top1": agree / rows, "acceptance": acc, "mean": mean, "best_scale": best}
    if lookup:
        res["lookup_gate"] = dict(lookup_gate_table(fired, int(rows), pdm_right, gate_confidences, gate_ratios),
                                  lookup=lookup)
        if parts["base"] and copy_boosts:
            si = list(scales).index(best)
            copies = {k: torch.cat(v) for k, v in parts.items()}
            # the gate's inputs of the same matched rows, in the same order
            copies["top"], copies["p_copy"] = torch.tensor([f[0] for f in fired]), torch.tensor([f[1] for f in fired])
            copies["inside"] = torch.tensor([f[2] for f in fired])
            copies["base"], copies["boost"] = copies["base"][:, :, si], copies["boost"][:, :, si]
            res["copy_boost"] = dict(copy_boost_table(int(rows), {t: sums[(t, best)] for t in temperatures}, copies,
                                                      res["lookup_gate"]["best"], temperatures, copy_boosts),
                                     scale=best)
    return res


def _copy_rows(parts: dict, matches: list, slot: torch.Tensor, s_logits: torch.Tensor,
               t_logits: torch.Tensor, dv: torch.Tensor, temperatures: Sequence[float], scales: Sequence[float],
               boosts: Sequence[float]) -> None:
    """Append what copy_boost_table needs for the matched rows of one batch (every scale: the best one is
    only known after the pass)."""
    rows = torch.tensor([r for r, _ in matches])
    cop = torch.tensor([c for _, c in matches])
    V_d = len(dv)
    col = slot[cop].clamp_max(V_d - 1)[:, None]  # rows outside V_d: copy_boost_table drafts them one-hot
    lg = s_logits[rows]
    base = torch.zeros(len(rows), len(temperatures), len(scales))
    boost = torch.zeros(len(rows), len(temperatures), len(scales), len(boosts))
    one_hot = torch.zeros(len(rows), len(temperatures))
    for i, t in enumerate(temperatures):
        p = torch.softmax(t_logits[rows] / t, -1)
        one_hot[:, i] = p.gather(1, cop[:, None])[:, 0]
        p_dv = p[:, dv]
        for j, s in enumerate(scales):
            x = lg / (t * s)
            base[:, i, j] = torch.minimum(p_dv, torch.softmax(x, -1)).sum(-1)
            for k, d in enumerate(boosts):
                xb = x.scatter_add(1, col, torch.full_like(col, float(d), dtype=x.dtype))
                boost[:, i, j, k] = torch.minimum(p_dv, torch.softmax(xb, -1)).sum(-1)
    parts["base"].append(base)
    parts["boost"].append(boost)
    parts["one_hot"].append(one_hot)


_KEEP = object()


def write_scale(head_dir: str | Path, scale: float, lookup_gate: Sequence[float] | None = None,
                copy_boost: float | None | object = _KEEP) -> None:
    """Set draft_temperature_scale (and, if given, the lookup gate and the copy boost, None for one-hot
    copies) in a head directory's draft_config.json."""
    from ..pdm import read_draft_config
    from ..store import write_text_durably

    dcfg = dataclasses.replace(read_draft_config(head_dir), draft_temperature_scale=float(scale))
    if lookup_gate is not None:
        dcfg = dataclasses.replace(dcfg, lookup_gate_confidence=float(lookup_gate[0]),
                                   lookup_gate_ratio=float(lookup_gate[1]))
    if copy_boost is not _KEEP:
        dcfg = dataclasses.replace(dcfg, lookup_copy_boost=None if copy_boost is None else float(copy_boost))
    write_text_durably(Path(head_dir) / "draft_config.json", dcfg.to_json())  # never a head without its config


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _some_floats(text: str) -> list[float]:
    vals = _floats(text)
    if not vals:
        raise argparse.ArgumentTypeError(f"expected at least one number (comma-separated), got {text!r}")
    return vals


def _unique(values: Sequence) -> tuple:
    """Each grid value once, in order: one given twice was scored twice into one cell (its acceptance doubled, and
    it won)."""
    return tuple(dict.fromkeys(values))


def _check_writable(head: str | Path) -> None:
    """--write replaces HEAD/draft_config.json through a temporary file beside it: refuse before the run
    (minutes) when that cannot work, not with a traceback after it."""
    import os

    from ..config import SpdConfigError

    d = Path(head)
    if d.is_dir() and not os.access(d, os.W_OK | os.X_OK):
        raise SpdConfigError(f"--write cannot replace {d / 'draft_config.json'}: the directory {d} is not writable; "
                             "copy the head somewhere writable and calibrate the copy, or leave out --write")


def load_target_and_head(head_dir: str | Path, model: str | None = None, threads: int = 0):
    """The target (`model`, default the embedded one) and the head saved in `head_dir`, checked against it,
    for a teacher-forced scoring run on `threads` CPU threads (0: torch's default)."""
    from ..pdm import load_draft
    from ..runtime import load_target

    if threads:
        torch.set_num_threads(threads)
    target = load_target(model)
    return target, load_draft(head_dir, target.model, target.fingerprint)


def main(argv: list[str] | None = None) -> int:
    from ..cli_common import Parser, check_output, cli_message, non_negative_int, positive_int, thread_count
    from ..config import DEFAULT_LOOKUP, SpdConfigError

    p = Parser(prog="spd_fast.train.calibrate", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter, help_command="python -m spd_fast.train.calibrate")
    p.add_argument("head", help="head directory (draft_config.json + draft.safetensors)")
    p.add_argument("--model", help="HF directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--val", action="append", default=[],
                   help="held-out data (.jsonl/.jsonl.gz/.json/.txt/.parquet, as the trainer's --data); repeatable")
    p.add_argument("--val-limit", type=positive_int, default=140, help="use at most this many samples (default 140)")
    p.add_argument("--temperatures", type=_some_floats, default=list(DEFAULT_TEMPERATURES),
                   help=f"temperatures to fit the scale at (default {','.join(map(str, DEFAULT_TEMPERATURES))})")
    p.add_argument("--scales", type=_some_floats, default=list(DEFAULT_SCALES),
                   help=f"draft temperature scales to try (default {','.join(map(str, DEFAULT_SCALES))})")
    p.add_argument("--lookup", type=non_negative_int, default=DEFAULT_LOOKUP, metavar="K",
                   help=f"calibrate the lookup gate for context matches of K tokens (default {DEFAULT_LOOKUP}, "
                        "the runtime's default; 0 skips it)")
    csv = lambda v: ",".join(map(str, v))  # noqa: E731
    p.add_argument("--gate-confidences", type=_some_floats, default=list(DEFAULT_GATE_CONFIDENCES),
                   help=f"lookup gate: top PDM probabilities above which the PDM may keep its own draft over a "
                        f"context copy, to try (default {csv(DEFAULT_GATE_CONFIDENCES)})")
    p.add_argument("--gate-ratios", type=_some_floats, default=list(DEFAULT_GATE_RATIOS),
                   help=f"lookup gate: it keeps it when the copy's PDM probability is under RATIO times the top "
                        f"one; ratios to try (default {csv(DEFAULT_GATE_RATIOS)})")
    p.add_argument("--copy-boosts", type=_floats, default=list(DEFAULT_COPY_BOOSTS),
                   help=f"logit boosts of a copied token to try for sampled decoding (default "
                        f"{csv(DEFAULT_COPY_BOOSTS)}; empty: keep one-hot copies)")
    p.add_argument("--threads", type=thread_count, default=0, help="CPU threads (default 0: torch's default)")
    p.add_argument("--write", action="store_true",
                   help="store the best scale, lookup gate and copy boost in the head's draft_config.json")
    p.add_argument("--out", help="also write the result JSON here")
    a = p.parse_args(argv)
    for k in ("temperatures", "scales", "gate_confidences", "gate_ratios", "copy_boosts"):  # as calibrate() reads them
        setattr(a, k, _unique(getattr(a, k)))
    try:
        from .data import read_val_samples

        if not a.val:
            raise SpdConfigError("pass held-out data with --val FILE (not the head's training data)")
        gate_flags = [f for f, k, d in (("--gate-confidences", "gate_confidences", DEFAULT_GATE_CONFIDENCES),
                                        ("--gate-ratios", "gate_ratios", DEFAULT_GATE_RATIOS),
                                        ("--copy-boosts", "copy_boosts", DEFAULT_COPY_BOOSTS))
                      if set(getattr(a, k)) != set(d)]  # the default grid in any order asks for nothing new
        if a.lookup == 0 and gate_flags:  # refused rather than ignored, as everywhere
            one = len(gate_flags) == 1
            raise SpdConfigError(f"{' and '.join(gate_flags)} {'tunes' if one else 'tune'} the lookup gate and copy "
                                 f"boost, which --lookup 0 skips; drop {'it' if one else 'them'}, or pass "
                                 f"--lookup K > 0")
        check_output(a.out, "--out")
        if a.write:
            _check_writable(a.head)
        target, head = load_target_and_head(a.head, a.model, a.threads)
        samples = [r for r in read_val_samples(a.val, target) if r["response_ids"]][: a.val_limit]
        res = calibrate(target, head, samples, a.temperatures, a.scales,
                        lookup=a.lookup, gate_confidences=a.gate_confidences, gate_ratios=a.gate_ratios,
                        copy_boosts=a.copy_boosts)
    except SpdConfigError as e:
        print(f"spd_fast.train.calibrate: error: {cli_message(e, p)}", file=sys.stderr)
        return 2
    res["head"], res["val"] = str(a.head), a.val
    res["previous_scale"] = head.dcfg.draft_temperature_scale
    print("| scale | " + " | ".join(f"T={t}" for t in a.temperatures) + " | mean |")
    print("|---|" + "---|" * (len(a.temperatures) + 1))
    for s in a.scales:
        cells = " | ".join(f"{res['acceptance'][str(t)][str(s)]:.4f}" for t in a.temperatures)
        print(f"| {s} | {cells} | {res['mean'][str(s)]:.4f} |")
    print(f"best scale {res['best_scale']} (rows {res['rows']}, greedy top-1 {res['top1']:.4f})")
    gate = res.get("lookup_gate")
    if gate:
        print(f"\nlookup gate (k={a.lookup}; {gate['rows_matched']} of {gate['rows']} rows matched): greedy draft "
              f"accuracy, PDM alone {gate['pdm_alone']:.4f}, every match copied {gate['no_gate']:.4f}")
        print("| confidence | " + " | ".join(f"ratio {r}" for r in a.gate_ratios) + " |")
        print("|---|" + "---|" * len(a.gate_ratios))
        for c in a.gate_confidences:
            print(f"| {c} | " + " | ".join(f"{gate['grid'][f'{c},{r}']:.4f}" for r in a.gate_ratios) + " |")
        print(f"best gate: confidence {gate['best'][0]}, ratio {gate['best'][1]} ({gate['best_accuracy']:.4f})")
    cb = res.get("copy_boost")
    if cb:
        print(f"\ncopy boost (sampled decoding, scale {cb['scale']}, {cb['rows_matched']} matched rows): expected "
              "acceptance")
        print("| copy | " + " | ".join(f"T={t}" for t in a.temperatures) + " | mean |")
        print("|---|" + "---|" * (len(a.temperatures) + 1))
        for name, acc in [("one-hot (gated)", cb["one_hot"])] + [(f"boost {d}", cb["grid"][str(d)])
                                                                  for d in a.copy_boosts]:
            print(f"| {name} | " + " | ".join(f"{acc[str(t)]:.4f}" for t in a.temperatures)
                  + f" | {sum(acc.values()) / len(acc):.4f} |")
        print(f"best: {'one-hot' if cb['best'] is None else 'boost ' + str(cb['best'])} ({cb['best_mean']:.4f})")
    try:
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=2))
        if a.write:
            _write(a, res, gate, cb)
    except (OSError, SpdConfigError) as e:  # the run is done: say what was not written and why, no traceback
        what = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else cli_message(e, p)
        print(f"spd_fast.train.calibrate: error: the results were not all written ({what}); the figures above are "
              "the run's: fix the path and run again", file=sys.stderr)
        return 2
    return 0


def _write(a: argparse.Namespace, res: dict, gate: dict | None, cb: dict | None) -> None:
    """--write: the fitted calibration into the head's draft_config.json."""
    if gate and not gate["rows_matched"]:  # no evidence: its "best" would be no gate at all
        print(f"no validation row's {a.lookup} newest tokens occurred earlier in its context, so the lookup gate "
              f"is not fitted; pass longer --val samples (repetitive ones, such as code) to fit it")
        gate = None
    if cb:
        boost = cb["best"]
    elif a.lookup > 0 and not a.copy_boosts:  # "--copy-boosts ''": one-hot copies, as its help says
        boost = None
    else:
        boost = _KEEP
    write_scale(a.head, res["best_scale"], gate["best"] if gate else None, boost)
    kept = [name for name, fitted in (("lookup gate", gate), ("copy boost", boost is not _KEEP)) if not fitted]
    print(f"wrote draft_temperature_scale={res['best_scale']}"
          + (f", lookup_gate_confidence={gate['best'][0]}, lookup_gate_ratio={gate['best'][1]}" if gate else "")
          + (f", lookup_copy_boost={boost}" if boost is not _KEEP else "")
          + f" to {Path(a.head) / 'draft_config.json'}"
          + (f" (kept as they were: {', '.join(kept)})" if kept else ""))


if __name__ == "__main__":
    sys.exit(main())
