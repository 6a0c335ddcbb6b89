"""Acceptance evaluation on the project's held-out prompt sets (chat / math / code).

For each n and temperature: acceptance_rate, tokens_per_cycle and equivalent_accept_length per
category and overall, plus wall-clock SPD decode tokens/s and the AR baseline of the same model
measured in the same run, and what the answers were like: their mean length and how much of them
repeats earlier 4-grams (repeat_share). Used by `spd-fast eval` and bench/eval_acceptance.py.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from .cli_common import our_warnings, result_paths, write_output
from .config import DEFAULT_LOOKUP, SpdConfigError, check_seed, validate_num_stages
from .progress import bar
from .store import DEFAULT_MODEL_NAME

CATEGORIES = ("chat", "math", "code")
_SUMS = ("ver", "acc", "cycles", "decoded", "spd_s", "ar_s", "ar_tok", "answers", "new_tok", "rep", "rep_of")
REPEAT_K = 4  # repeat_share's n-gram length
BOOTSTRAP_REPS = 2000


def _resampled_rates(pairs: Sequence[Sequence[float]], idx: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(pairs, dtype=torch.float64)
    return t[idx, 1].sum(-1) / t[idx, 0].sum(-1).clamp(min=1)


def _bootstrap_index(count: int, reps: int, seed: int) -> torch.Tensor:
    return torch.randint(count, (reps, count), generator=torch.Generator().manual_seed(seed))


def _interval(samples: torch.Tensor, level: float) -> tuple[float, float]:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(samples, q).tolist()
    return lo, hi


def acceptance_ci(pairs: Sequence[Sequence[float]], level: float = 0.95, reps: int = BOOTSTRAP_REPS,
                  seed: int = 0) -> tuple[float, float]:
    """Bootstrap confidence interval of the pooled acceptance rate over prompts. `pairs` holds one
    (verifications, accepted) per prompt; whole prompts are resampled, since the verifications of one
    answer are not independent (a binomial interval over verifications would be too narrow)."""
    if not pairs:
        raise SpdConfigError("acceptance_ci needs at least one prompt's (verifications, accepted)")
    return _interval(_resampled_rates(pairs, _bootstrap_index(len(pairs), reps, seed)), level)


def paired_difference(base: Sequence[Sequence[float]], new: Sequence[Sequence[float]], level: float = 0.95,
                      reps: int = BOOTSTRAP_REPS, seed: int = 0) -> dict[str, float]:
    """new minus base acceptance on the SAME prompts (index i is one prompt in both), with a paired
    bootstrap interval: each resample draws prompt indices once and scores both runs on them, so the
    prompt-to-prompt spread, which both runs share, cancels."""
    if len(base) != len(new) or not base:
        raise SpdConfigError(f"a paired comparison needs the same prompts in both runs, got {len(base)} and "
                             f"{len(new)} prompts; run both evaluations with the same --limit and categories")
    idx = _bootstrap_index(len(base), reps, seed)
    lo, hi = _interval(_resampled_rates(new, idx) - _resampled_rates(base, idx), level)
    every = torch.arange(len(base))  # each prompt once: the pooled rates of the runs themselves
    b, nw = float(_resampled_rates(base, every)), float(_resampled_rates(new, every))
    return {"base": b, "new": nw, "difference": nw - b, "ci_low": lo, "ci_high": hi}


def repeat_share(ids: Sequence[int], k: int = REPEAT_K) -> tuple[int, int]:
    """(repeated, counted) over an answer's tokens from the k-th on: a token is repeated when the k-gram
    that ends with it already ended at an earlier position of the same answer. A high share means
    looping or copied text, which drafts (the context lookup above all) find easy; it depends on the
    text only, so it is the same for SPD and AR at temperature 0."""
    seen: set[tuple[int, ...]] = set()
    rep = 0
    for i in range(k - 1, len(ids)):
        g = tuple(ids[i - k + 1:i + 1])
        rep += g in seen
        seen.add(g)
    return rep, max(0, len(ids) - k + 1)


def load_eval_prompts(categories: Sequence[str] = CATEGORIES, limit: int = 40) -> dict[str, list[dict]]:
    """category -> the first `limit` records ({"id", "prompt"}) of spd_fast/data/prompts/eval_<category>.jsonl."""
    from .train.data import PROMPTS_DIR, read_jsonl

    if limit < 1:
        raise SpdConfigError(f"limit must be >= 1 prompt per category, got {limit}")
    out = {}
    for c in categories:
        if c not in CATEGORIES:
            raise SpdConfigError(f"unknown prompt category {c!r}; choose from {', '.join(CATEGORIES)}")
        rows = read_jsonl(PROMPTS_DIR / f"eval_{c}.jsonl")
        if limit > len(rows):  # else the results would claim a sample the run never had
            raise SpdConfigError(f"limit {limit} is more than the {len(rows)} {c} prompts there are; "
                                 f"use a limit of at most {len(rows)}")
        out[c] = rows[:limit]
    return out


def add_spd_metrics(acc: dict[str, float], m: dict[str, float], seconds_key: str = "spd_s") -> None:
    """Add one SPD run's raw counts to a running sum (pooled rates, not averages of rates)."""
    acc["ver"] += m["verifications"]
    acc["acc"] += m["accepted"]
    acc["cycles"] += m["cycles"]
    acc["decoded"] += m["new_tokens"] - 1
    acc[seconds_key] += m["decode_seconds"]


def add_answer_stats(acc: dict[str, float], ids: Sequence[int]) -> None:
    """Add one answer's length and repeat_share counts to a running sum."""
    rep, of = repeat_share(ids)
    acc["answers"] += 1
    acc["new_tok"] += len(ids)
    acc["rep"] += rep
    acc["rep_of"] += of


def _row(n: int, temp: float, cat: str, prompts: int, c: dict[str, float],
         per_prompt: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
    tpc = c["decoded"] / max(1, c["cycles"])
    row: dict[str, Any] = {"n": n, "temperature": temp, "category": cat, "prompts": prompts,
                           "acceptance_rate": c["acc"] / max(1, c["ver"]), "tokens_per_cycle": tpc,
                           "equivalent_accept_length": n * tpc,
                           "spd_tokens_per_s": c["decoded"] / max(1e-9, c["spd_s"]),
                           "mean_new_tokens": c["new_tok"] / max(1, c["answers"]),
                           "answer_repeat_share": c["rep"] / max(1, c["rep_of"]),
                           # raw counts, so rows of runs with other lengths or prompts can be pooled or differenced
                           "verifications": int(c["ver"]), "accepted": int(c["acc"]), "cycles": int(c["cycles"]),
                           "decoded_tokens": int(c["decoded"])}
    if per_prompt:
        # one [verifications, accepted] per prompt, in prompt order: the bootstrap interval, and a paired
        # comparison of two runs on the same prompts (bench/compare_acceptance.py)
        row["per_prompt"] = [[int(v), int(k)] for v, k in per_prompt]
        row["acceptance_ci95"] = list(acceptance_ci(per_prompt))
    if c["ar_tok"]:
        row["ar_tokens_per_s"] = c["ar_tok"] / max(1e-9, c["ar_s"])
        row["speedup_vs_ar"] = row["spd_tokens_per_s"] / row["ar_tokens_per_s"]
    return row


def evaluate_acceptance(num_stages: Sequence[int] = (3,), temperatures: Sequence[float] = (0.0,),
                        limit: int = 40, max_new_tokens: int = 96, draft: str | None = None,
                        categories: Sequence[str] = CATEGORIES, with_ar: bool = True, model: str | None = None,
                        dtype: str = "float32", device: str = "cpu", progress: bool = True,
                        on_row: Any = None, seed: int = 0, lookup: int = DEFAULT_LOOKUP, placement: str = "local",
                        cuda_graphs: bool | None = None, max_len: int = 2048,
                        on_warning: Any = None) -> dict[str, Any]:
    """Run the evaluation; return {"meta": {...}, "rows": [...]} (one row per n, temperature, category
    and an "overall" row). AR runs once per prompt, with the first n (it does not depend on n); every
    n's rows get its tokens/s and the SPD/AR ratio, and greedy SPD is checked against it at every n.
    Prompt i of a category samples with seed `seed + i` (SPD and AR alike); at temperature > 0 a
    few seeds tell a real difference between two heads from sampling noise. lookup: the drafter's
    context lookup (spd_fast.load); 0 measures the PDM alone. placement / cuda_graphs: the executor, as in
    spd_fast.load (acceptance does not depend on it; the SPD tokens/s do).
    max_len: the KV cache length (prompt + max_new_tokens + n + 1 must fit). on_warning(text): where spd_fast's own
    warnings at load go (e.g. "no shipped draft head ... random head"); default: re-issued with `warnings.warn`.
    Greedy SPD must reproduce AR token for token; a mismatch raises RuntimeError."""
    made_by = provenance()  # the code that runs, read before a commit landing mid-run could move HEAD
    import spd_fast

    if not num_stages:
        raise SpdConfigError("give at least one number of stages, e.g. num_stages=(3,)")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 2:
        raise SpdConfigError(f"max_new_tokens must be an integer >= 2 to measure acceptance (the first token comes "
                             f"from the prefill, before any draft is verified), got {max_new_tokens!r}")
    prompts = load_eval_prompts(categories, limit)
    from .pdm import check_draft_stages

    check_draft_stages(draft, num_stages)  # a head for one n, asked for several: refused before the first run
    last = max(len(ps) for ps in prompts.values()) - 1
    check_seed(seed)
    try:  # prompt i samples with seed + i: the last one must be a seed too
        check_seed(seed + last)
    except SpdConfigError:
        raise SpdConfigError(f"seed {seed} is too large for {last + 1} prompts per category (prompt i samples with "
                             f"seed + i, at most 2**64 - 1); use a seed <= {2**64 - 1 - last}") from None
    rows: list[dict[str, Any]] = []
    sources, digests = [], []
    ar_runs: dict[tuple[float, str, int], tuple[list[int], float, int]] = {}  # (temp, cat, i) -> AR result
    for k, n in enumerate(num_stages):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng = spd_fast.load(model=model, draft=draft, num_stages=n, dtype=dtype, device=device,
                                progress=progress, lookup=lookup, placement=placement, cuda_graphs=cuda_graphs,
                                max_len=max_len)
        for w in our_warnings(caught):  # library chatter is not the reader's business
            if on_warning is not None:
                on_warning(str(w.message))
            else:
                warnings.warn(w.message, stacklevel=2)
        if k == 0:  # every n against the model, before the first one's run
            for m in num_stages:
                validate_num_stages(eng.target.cfg.num_layers, m)
            check_prompts_fit(eng, [(f"{cat} {rec.get('id', i)}", [{"role": "user", "content": rec["prompt"]}])
                                    for cat, ps in prompts.items() for i, rec in enumerate(ps)],
                              max_new_tokens, max(num_stages), with_ar, "eval")
        sources.append(eng.draft_source)
        digests.append(eng.draft_digest)
        fingerprint = eng.target.fingerprint
        for temp in temperatures:
            per_cat, per_prompt = {}, {}
            for cat, ps in prompts.items():
                acc = dict.fromkeys(_SUMS, 0.0)
                pp = per_prompt[cat] = []
                for i, rec in enumerate(bar(ps, f"eval n={n} T={temp} {cat}", enabled=progress)):
                    msgs = [{"role": "user", "content": rec["prompt"]}]
                    o = eng.generate(msgs, max_new_tokens, temperature=temp, seed=seed + i, method="spd")
                    add_spd_metrics(acc, o.metrics)
                    pp.append((o.metrics["verifications"], o.metrics["accepted"]))
                    add_answer_stats(acc, o.token_ids)
                    if with_ar:
                        if (temp, cat, i) not in ar_runs:
                            r = eng.generate(msgs, max_new_tokens, temperature=temp, seed=seed + i, method="ar")
                            ar_runs[temp, cat, i] = (r.token_ids, r.metrics["decode_seconds"],
                                                     r.metrics["new_tokens"] - 1)
                        ar_ids, ar_s, ar_tok = ar_runs[temp, cat, i]
                        if temp == 0 and ar_ids != o.token_ids:
                            raise GreedyMismatch(f"greedy SPD output differs from AR on prompt {rec.get('id', i)} "
                                                 f"(n={n}); this is a bug, please report it with this prompt")
                        acc["ar_s"] += ar_s
                        acc["ar_tok"] += ar_tok
                per_cat[cat] = acc
            tot = {k: sum(c[k] for c in per_cat.values()) for k in _SUMS}
            for cat, c in list(per_cat.items()) + [("overall", tot)]:
                count = len(prompts[cat]) if cat in prompts else sum(len(v) for v in prompts.values())
                pp = per_prompt[cat] if cat in per_prompt else [x for v in per_prompt.values() for x in v]
                row = _row(n, temp, cat, count, c, pp)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
        del eng
    from .runtime import cpu_name
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": cpu_name(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "draft": sources[0] if len(set(sources)) == 1 else sources,
            "draft_digest": digests[0] if len(set(digests)) == 1 else digests, "max_new_tokens": max_new_tokens,
            "limit": limit, "categories": list(categories), "seed": seed, "lookup": lookup,
            "model": model or DEFAULT_MODEL_NAME, "model_fingerprint": fingerprint, "dtype": dtype_name(dtype),
            "device": str(device), "placement": placement, "kernels": kernel_backend(),
            "kernels_run": kernel_backend(device), "cuda_graphs": cuda_graphs, "max_len": max_len, **made_by}
    return {"meta": meta, "rows": rows}


def provenance() -> dict[str, Any]:
    """What made a result: spd_fast's and transformers' versions, and when the package runs from a git checkout
    its commit and whether tracked files differed from it (`dirty`); None where that cannot be read."""
    import subprocess

    import transformers

    from . import __version__

    root = Path(__file__).resolve().parent.parent
    commit = dirty = None
    if (root / ".git").exists():
        try:
            git = ["git", "-C", str(root)]
            commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                    check=True).stdout.strip()
            dirty = bool(subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                        text=True, timeout=10, check=True).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            commit = dirty = None
    return {"spd_fast": __version__, "transformers": transformers.__version__, "commit": commit, "dirty": dirty}


def dtype_name(dtype: Any) -> str:
    """One spelling of a dtype for result files ("fp32", "float32" and torch.float32 are "float32"), so runs of
    the same settings pair (compare_acceptance.py); a value parse_dtype refuses is kept as given."""
    from .runtime import parse_dtype

    try:  # "torch.float32": how earlier results recorded the API's dtype
        parsed = parse_dtype(dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype)
        return str(parsed).removeprefix("torch.")
    except SpdConfigError:
        return str(dtype)


def check_prompts_fit(eng: Any, prompts: Sequence[tuple[str, Any]], max_new_tokens: int, max_n: int, with_ar: bool,
                      command: str) -> None:
    """Before any run of `command` (eval, bench): every prompt goes through the chat template, and the longest,
    with its new tokens and the in-flight slots of the largest n, fits the KV cache (--max-len) and the model's
    context; named with the --max-len it needs (the held-out prompts cannot be shortened). Each run checks its own
    prompt too, but only once every earlier one has run."""
    if getattr(eng.target.tokenizer, "chat_template", None) is None:
        raise SpdConfigError(f"{command} asks its prompts through the model's chat template, and this model's "
                             f"tokenizer has none (a base model); use a chat (instruct) model, or time a base model "
                             f"with `spd-fast generate` on a plain-text prompt")
    lens = [(name, len(eng.target.encode(msgs))) for name, msgs in prompts]
    name, longest = max(lens, key=lambda x: x[1])
    ctx = eng.target.cfg.max_position_embeddings
    if longest + max_new_tokens > ctx:
        raise SpdConfigError(f"prompt {name} ({longest} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                             f"model's context ({ctx} positions); lower --max-new-tokens to {ctx - longest}")
    slots = max(max_n + 1, eng._extra_slots("ar") if with_ar else 0)
    need = longest + max_new_tokens + slots
    if need > eng.max_len:
        raise SpdConfigError(f"prompt {name} ({longest} tokens) + --max-new-tokens {max_new_tokens} + {slots} "
                             f"in-flight slots (n={max_n}) = {need} exceeds the KV cache length {eng.max_len}; "
                             f"pass --max-len {need} (or more), or lower --max-new-tokens")


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| n | temp | category | acceptance | tokens/cycle | equiv. accept length | SPD tok/s | AR tok/s "
             "| SPD/AR | answer tokens | repeated 4-grams | acceptance 95% CI |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ar = f"{r['ar_tokens_per_s']:.1f}" if "ar_tokens_per_s" in r else "not run"
        ratio = f"{r['speedup_vs_ar']:.2f}" if "speedup_vs_ar" in r else "not run"
        length = f"{r['mean_new_tokens']:.0f}" if "mean_new_tokens" in r else "-"   # rows from older runs lack these
        rep = f"{r['answer_repeat_share']:.3f}" if "answer_repeat_share" in r else "-"
        ci = "{:.3f}-{:.3f}".format(*r["acceptance_ci95"]) if "acceptance_ci95" in r else "-"
        lines.append(f"| {r['n']} | {r['temperature']} | {r['category']} | {r['acceptance_rate']:.3f} | "
                     f"{r['tokens_per_cycle']:.3f} | {r['equivalent_accept_length']:.2f} | "
                     f"{r['spd_tokens_per_s']:.1f} | {ar} | {ratio} | {length} | {rep} | {ci} |")
    return "\n".join(lines)


def write_results(result: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """Write <out>.json and <out>.md (a .json or .md suffix on `out` is replaced, other dots are kept:
    `cli_common.result_paths`); return both paths. A file that cannot be written raises SpdConfigError."""
    js, md = result_paths(out)
    write_output(js, json.dumps(result, indent=2))
    write_output(md, f"draft: {result['meta']['draft']}; {result['meta']}\n\n" + markdown_table(result["rows"]) + "\n")
    return js, md


def kernel_backend(device: Any = None) -> str:
    """The fused-op backend in use (spd_fast.kernels), "torch" where that module cannot load; with `device`, the one
    that really runs there ("auto" resolved: cpp or torch on a CPU, triton or torch on a GPU)."""
    try:
        from . import kernels

        b = kernels.get_backend()
        if device is not None:
            import torch

            b = kernels.resolve(b, torch.device(device))
        return b
    except (ImportError, AttributeError, SpdConfigError):
        return "torch"


class GreedyMismatch(RuntimeError):
    """Greedy SPD gave other tokens than greedy AR: a bug, never a result."""


# ---- where acceptance comes from ------------------------------------------------------------------
WINDOWS = (1, 64, 128, 256)  # answer-position windows start here: 1-63, 64-127, 128-255, 256 and later


def window_label(a: int) -> str:
    """The WINDOWS bucket of answer position a >= 1 (position 0 is the prefill's exact token)."""
    i = max(j for j, w in enumerate(WINDOWS) if w <= a)
    return f"answer tokens {WINDOWS[i]}-{WINDOWS[i + 1] - 1}" if i + 1 < len(WINDOWS) else f"answer tokens {WINDOWS[i]}+"


class _RecordingDrafter:
    """Wraps an engine's drafter and records every draft: (position, token, context, lookup fired, fill).
    The lookup fired when the k newest tokens matched earlier and the draft is the copied token (a head's
    lookup gate may keep the PDM's own draft over a match); fill is the number of tokens in flight,
    the newest included, when the draft was made (n in the steady state, 1 right after a reject)."""

    def __init__(self, inner):
        self.inner = inner
        self.rows: list[tuple[int, int, torch.Tensor, bool, int]] = []
        self.prompt: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, engine, st) -> None:
        self.inner.prefill(engine, st)
        self.prompt = st.tokens[:st.prompt_len].tolist()

    def draft(self, engine, st, params, generator):
        from .ops import lookup_next

        tok, q = self.inner.draft(engine, st, params, generator)
        p = int(st.p_new)
        k = getattr(self.inner, "lookup", 0)
        fired = False
        if k and p >= k:
            found, copied = lookup_next(st.tokens[:p + 1], st.p_new, k)
            fired = bool(found) and int(copied) == int(tok)
        self.rows.append((p + 1, int(tok), st.tokens[:p + 1].clone(), fired, int(st.fill)))
        return tok, q


def classify_verified(rows: Sequence[tuple[int, int, torch.Tensor, bool, int]], full: Sequence[int],
                      prompt_len: int, k: int = REPEAT_K) -> list[dict[str, Any]]:
    """The verified drafts of one greedy SPD run and their classes. A draft is verified exactly when it was
    made in the right context (every token before it is in the final output) and its position holds an
    output token; it was accepted iff it equals that token (temperature 0). Classes: the answer-position
    window, whether the output token closes a k-gram seen earlier in the answer (repeat_share's rule),
    whether the context lookup made the draft, and the fill it was made at."""
    full_t = torch.tensor(list(full))
    seen: set[tuple[int, ...]] = set()
    repeated = {}
    for j in range(prompt_len + k - 1, len(full)):
        g = tuple(full[j - k + 1:j + 1])
        repeated[j] = g in seen
        seen.add(g)
    out = []
    for pos, tok, ctx, fired, fill in rows:
        if pos >= len(full) or pos < prompt_len + 1 or not torch.equal(ctx, full_t[:pos]):
            continue
        out.append({"pos": pos, "accepted": tok == full[pos], "window": window_label(pos - prompt_len),
                    "repeated": repeated.get(pos, False), "lookup": fired, "fill": fill})
    return out


def acceptance_breakdown(engine, prompts: dict[str, list[dict]], max_new_tokens: int,
                         progress: bool = False) -> dict[str, Any]:
    """Greedy SPD over `prompts` (category -> records) with `engine` (spd_fast.load), recording every
    draft; returns verified/accepted counts per category and class (see classify_verified), and the
    engine's own counts, which the recorded ones must equal. Keys "A / B" count the drafts in both classes
    (answer window or drafter, by repeated or new 4-gram); "fill f" the drafts made with f tokens in flight
    (f < n: the warm-up after a reject, where more of the context is at full depth)."""
    spd = engine.spd
    rec = _RecordingDrafter(spd.drafter)
    spd.drafter = rec
    counts: dict[str, list[int]] = {}
    engine_counts = [0, 0]

    def add(key: str, ok: bool) -> None:
        c = counts.setdefault(key, [0, 0])
        c[0] += 1
        c[1] += int(ok)

    try:
        for cat, ps in prompts.items():
            for r in bar(ps, f"breakdown {cat}", enabled=progress):
                rec.rows = []
                o = engine.generate([{"role": "user", "content": r["prompt"]}], max_new_tokens, temperature=0.0,
                                    method="spd")
                full = rec.prompt + o.token_ids
                engine_counts[0] += int(o.metrics["verifications"])
                engine_counts[1] += int(o.metrics["accepted"])
                for v in classify_verified(rec.rows, full, len(rec.prompt)):
                    text = "repeated 4-gram" if v["repeated"] else "new 4-gram"
                    drafter = "lookup draft" if v["lookup"] else "PDM draft"
                    for key in ("overall", cat, v["window"], text, drafter, f"{v['window']} / {text}",
                                f"{drafter} / {text}", f"fill {v['fill']}"):
                        add(key, v["accepted"])
    finally:
        spd.drafter = rec.inner
    return {"counts": {k: {"verified": v[0], "accepted": v[1], "acceptance_rate": v[1] / max(1, v[0])}
                       for k, v in counts.items()},
            "engine": {"verifications": engine_counts[0], "accepted": engine_counts[1]}}
