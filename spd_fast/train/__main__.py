"""`python -m spd_fast.train`: self-distil data with the target, then train a PDM draft head."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def build_parser(help_command: str = "python -m spd_fast.train") -> argparse.ArgumentParser:
    from ..cli_common import (DefaultsFormatter, Parser, bounded_float, layer_list, non_negative_float, non_negative_int,
                              positive_float, positive_int, seed_int, thread_count)

    p = Parser(prog="spd_fast.train", description="Train a Pipeline Draft Module (draft head). The last checkpoint "
               "is OUT/head and, with --val, the best on validation OUT/best_head: pass either as `draft`.",
               formatter_class=DefaultsFormatter, help_command=help_command)
    p.add_argument("--model", help="HF directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory (checkpoints, logs; resumes from it)")
    p.add_argument("--num-stages", type=positive_int, default=None,
                   help="n (default: len(--boundaries) - 1 when they are given, else 3)")
    p.add_argument("--boundaries", type=layer_list, help="e.g. 0,10,20,30")
    p.add_argument("--anchors", type=layer_list, help="default: the boundaries")
    p.add_argument("--draft-layers", type=positive_int, default=1, help="L_s, decoder layers of the head")
    p.add_argument("--draft-vocab", type=positive_int, default=16384, help="draft vocabulary size V_d")
    p.add_argument("--train-lm-head", action="store_true",
                   help="train the head's own LM-head rows (initialised from the target's) instead of sharing the "
                        "target's frozen rows: more capacity at no inference cost, V_d x H more weights stored")
    p.add_argument("--data", action="append", default=[],
                   help="training data: 'self-distill' (default; needs a chat template) or a .jsonl/.jsonl.gz/.json/"
                        ".txt/.parquet file; repeatable")
    p.add_argument("--prompts", help="prompt set for self-distillation (default: the project's train.jsonl)")
    p.add_argument("--max-prompts", type=non_negative_int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument("--gen-max-new-tokens", type=positive_int, default=128,
                   help="self-distillation: answer tokens per prompt at most")
    p.add_argument("--gen-batch", type=positive_int, default=64, help="self-distillation: prompts answered at once")
    p.add_argument("--gen-temperature", type=non_negative_float, default=0.0,
                   help="self-distillation: sampling temperature of the answers (0 = greedy)")
    p.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps (the LR schedule's length)")
    p.add_argument("--epochs", type=non_negative_float, default=0, help="if > 0, overrides --steps")
    p.add_argument("--lr", type=positive_float, default=5e-4, help="peak learning rate (AdamW; linear decay)")
    p.add_argument("--warmup", type=non_negative_int, default=50, help="linear warmup steps")
    p.add_argument("--batch-tokens", type=positive_int, default=2048,
                   help="padded tokens per batch (per rank under torchrun)")
    p.add_argument("--max-seq-len", type=positive_int, default=512,
                   help="tokens of each sample (prompt + answer) the head trains on; longer ones are cut, and "
                        "samples whose answer starts past it are dropped (both counted in the log)")
    p.add_argument("--fill-aug", type=bounded_float(0.0, 1.0), default=0.5,
                   help="probability of a fill-augmented step")
    p.add_argument("--fill-after-miss", action="store_true",
                   help="train the fill-augmented steps only on the rows the pipeline drafts at that fill after a "
                        "reject: the head's own draft f tokens back missed, and its refill drafts since were right "
                        "(default: rows at every position)")
    p.add_argument("--argmax-weight", type=non_negative_float, default=0.0,
                   help="add this times the cross-entropy on the target's argmax token to the KL loss "
                        "(weights greedy agreement above matching the whole distribution)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fast on GPUs and CPUs with AMX/AVX512-BF16; "
                   "emulated and slower than fp32 on other CPUs, which get a warning)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the target (teacher) and the head run")
    p.add_argument("--dtype", default="float32", help="the target's weights: float32, bfloat16 or float16 (on a GPU, "
                   "bfloat16 with --bf16 halves the teacher's memory traffic)")
    p.add_argument("--time-budget", type=non_negative_float, default=0.0,
                   help="seconds of training: after 20 timed steps the step count (and the LR decay) is cut to "
                        "what fits; 0 = off. Rerun with the same --steps, a finished run stays finished; another "
                        "--steps extends it")
    p.add_argument("--save-every", type=positive_int, default=50,
                   help="steps between checkpoints (and validations with --val)")
    p.add_argument("--seed", type=seed_int, default=0, help="seeds the head's initialisation, batch order and fill "
                   "augmentation")
    p.add_argument("--threads", type=thread_count, default=0, help="CPU threads (0 = torch's default)")
    p.add_argument("--no-resume", action="store_true",
                   help="start over in --out instead of resuming the run saved there")
    p.add_argument("--init", default=None,
                   help="warm-start from this head directory (same anchors and V_d), e.g. to fine-tune "
                        "the shipped head on new data; a larger --draft-layers grows it (new layers start "
                        "as the identity); another --num-stages adapts it to that split (keep its --anchors)")
    p.add_argument("--val", action="append", default=[],
                   help="held-out data file (same formats as --data, repeatable): KL and top-1 agreement at every "
                        "checkpoint, best head kept in OUT/best_head")
    p.add_argument("--val-limit", type=positive_int, default=64, help="score at most this many validation samples")
    p.add_argument("--weight-decay", type=non_negative_float, default=0.0, help="AdamW weight decay")
    p.add_argument("--no-feature-cache", action="store_true",
                   help="run the teacher every step instead of caching its states on disk once (saves disk, costs time)")
    return p


def bf16_cpu_warning(cpuinfo: str | None = None) -> str | None:
    """A warning when this CPU has no native bf16 matmul (AVX512-BF16, AMX or Arm bf16): there, bf16 autocast is
    emulated and slower than fp32 (measured 4.5x on an AVX2 EPYC for the teacher's 4096 x 576 x 1536
    GEMM). None when it has one, or when /proc/cpuinfo cannot tell."""
    from ..runtime import cpu_info

    _, flags = cpu_info(cpuinfo)
    if not flags or flags & {"avx512_bf16", "amx_bf16", "bf16"}:  # bf16: Arm (BFMMLA)
        return None
    return ("--bf16 on this CPU (no AVX512-BF16, AMX or Arm bf16) is emulated and several times slower than fp32 "
            "for both the teacher cache and training; drop --bf16 here")


def main(argv: list[str] | None = None, help_command: str = "python -m spd_fast.train") -> int:
    from ..cli_common import cli_message
    from ..config import SpdConfigError
    from ..runtime import load_target
    from . import heap
    from .data import OPENING_TURN, load_prompts, read_jsonl, read_val_samples, self_distill, text_file_samples
    from .trainer import (TrainConfig, drop_unlearnable, epoch_steps, init_lead_wait, pack_batches, train,
                          wait_for_lead)

    a = build_parser(help_command).parse_args(argv)
    rank, world = 0, 1
    try:
        from ..runtime import parse_device, parse_dtype

        device, dtype = parse_device(a.device), parse_dtype(a.dtype)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: data parallel, one rank per GPU (gloo on CPU)
            from ..distributed.launch import init_rank

            # a rank waits in a collective while rank 0 validates or writes a checkpoint: allow it
            ctx = init_rank(a.device, startup_timeout=3600.0)
            rank, world, device = ctx.rank, ctx.world_size, ctx.device
            init_lead_wait()  # longer waits: rank 0 alone self-distils or builds the teacher cache
    except SpdConfigError as e:
        print(f"spd_fast.train: error: {cli_message(e, build_parser())}", file=sys.stderr)
        return 2
    if device.type == "cpu":
        heap.tune()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.bf16 and device.type == "cpu" and (warning := bf16_cpu_warning()):
        print(f"spd_fast.train: warning: {warning}", file=sys.stderr)
    if not a.out.strip():  # "" is the current directory: a run (and a later resume) in whatever directory that is
        print("spd_fast.train: error: --out is empty; name the run's directory (it is created, or resumed from)",
              file=sys.stderr)
        return 2
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        print(f"spd_fast.train: error: --out {out} is a file; pass a directory (it is created, or resumed from)",
              file=sys.stderr)
        return 2
    if a.num_stages is None:
        a.num_stages = len(a.boundaries) - 1 if a.boundaries else 3
    elif a.boundaries and len(a.boundaries) - 1 != a.num_stages:
        print(f"spd_fast.train: error: --boundaries {','.join(map(str, a.boundaries))} make "
              f"{len(a.boundaries) - 1} stages, not --num-stages {a.num_stages}; drop one of the two", file=sys.stderr)
        return 2
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"spd_fast.train: error: cannot create --out {out} ({e.strerror}); choose another path", file=sys.stderr)
        return 2
    log_f = open(out / "train_log.jsonl", "a") if rank == 0 else None

    def log(msg: str) -> None:
        if log_f is not None:
            print(msg, file=sys.stderr, flush=True)
            # every line of the log is a JSON object: a sentence goes in as {"message": ...}
            log_f.write((msg if msg.startswith("{") else json.dumps({"message": msg})) + "\n")
            log_f.flush()

    try:
        target = load_target(a.model, dtype=dtype, device=device, warn_dtype=False)  # training does not decode packed
        samples: list[dict] = []
        if "self-distill" not in (a.data or ["self-distill"]):  # options of a data source this run does not use
            parser = build_parser()
            unused = [f"--{d.replace('_', '-')}" for d in ("prompts", "max_prompts", "gen_max_new_tokens", "gen_batch",
                                                         "gen_temperature") if getattr(a, d) != parser.get_default(d)]
            if unused:
                raise SpdConfigError(f"{', '.join(unused)} only apply to --data self-distill, which this run does not "
                                     f"use; drop them, or add --data self-distill")
        ignored = [why for why, on in (
            ("--fill-after-miss only shapes the fill-augmented steps, which --fill-aug 0 turns off; drop it or give "
             "--fill-aug a probability > 0", a.fill_after_miss and a.fill_aug == 0),
            ("--fill-after-miss only shapes the fill-augmented steps, which a 1-stage head never takes; drop it",
             a.fill_after_miss and a.fill_aug > 0 and a.num_stages == 1),
            ("--val-limit only applies to --val files, and none was given; drop it or add --val",
             not a.val and a.val_limit != build_parser().get_default("val_limit"))) if on]
        if ignored:
            raise SpdConfigError(ignored[0])
        ctx = target.cfg.max_position_embeddings
        if ctx and a.max_seq_len > ctx:  # positions the model was not trained for, which the runtime never decodes
            raise SpdConfigError(f"--max-seq-len {a.max_seq_len} is longer than the model's context ({ctx} "
                                 f"positions); pass --max-seq-len {ctx} or less")
        for src in a.data or ["self-distill"]:
            if src == "self-distill":
                prompts = load_prompts(a.prompts)
                if a.max_prompts:
                    prompts = prompts[: a.max_prompts]
                t0 = time.perf_counter()
                path = out / "self_distill.jsonl"
                if rank == 0:  # one rank writes the answers, the others read them
                    path = self_distill(target, prompts, path, a.gen_max_new_tokens, a.gen_batch,
                                        a.gen_temperature, a.seed)
                if world > 1:
                    wait_for_lead()
                log(json.dumps({"self_distill": str(path), "prompts": len(prompts),
                                "seconds": round(time.perf_counter() - t0, 1)}))
                chosen = {p["id"] for p in prompts}  # the file may hold answers to prompts of an earlier run
                samples += [dict(r, _source="self-distill") for r in read_jsonl(path) if r["id"] in chosen]
            else:
                if Path(src).is_dir():
                    raise SpdConfigError(f"data file {src} is a directory; pass its files, e.g. --data {src}/a.jsonl "
                                         f"--data {src}/b.jsonl")
                if not Path(src).is_file():
                    raise SpdConfigError(f"data file {src} does not exist")
                samples += [dict(r, _source=str(Path(src).resolve())) for r in text_file_samples(src, target)]
        if not samples:
            raise SpdConfigError(f"the data ({', '.join(a.data or ['self-distill'])}) hold no rows to train on; pass "
                                 f"files with rows, or --data self-distill")
        opening = sum(r.get("skipped") == OPENING_TURN for r in samples)  # a chat's first message, by the assistant
        empty = sum(not r["response_ids"] for r in samples) - opening  # nothing to take a loss on
        samples = [r for r in samples if r["response_ids"]]
        if not samples:
            raise SpdConfigError(f"every one of the {empty + opening} training samples has an empty answer (no tokens "
                                 f"to train on{f'; {opening} are opening assistant turns' if opening else ''}); check "
                                 f"the data files' \"text\", \"response_ids\" or assistant turns")
        if empty or opening:
            log(json.dumps({k: v for k, v in (("skipped_empty_samples", empty),
                                              ("skipped_opening_assistant_turns", opening)) if v}))
        samples, counts = drop_unlearnable(samples, a.max_seq_len)  # before the epoch's steps are counted
        if counts["dropped_samples"] or counts["cut_samples"]:
            log(json.dumps(counts))
        val = [r for r in read_val_samples(a.val, target) if r["response_ids"]][: a.val_limit]
        # rows whose answer starts past --max-seq-len score nothing: none at all would look like a perfect head
        val = drop_unlearnable(val, a.max_seq_len, "validation samples")[0]
        if a.val and not val:
            raise SpdConfigError(f"every --val sample has an empty answer ({', '.join(a.val)}); pass held-out samples "
                                 f"with answers, or leave --val out")
        steps = a.steps
        if a.epochs > 0:  # under torchrun each step takes one batch per rank
            def count(e: int) -> int:
                return len(pack_batches(samples, a.batch_tokens, a.max_seq_len, a.seed, e)) // world

            per_epoch = count(0)
            steps = epoch_steps(count, a.epochs)  # each epoch's own batch count
            if steps < 1:
                raise SpdConfigError(f"--epochs {a.epochs} is less than one step ({per_epoch} steps per epoch); "
                                     f"ask for more epochs or use --steps")
        cfg = TrainConfig(steps=steps, lr=a.lr, warmup=a.warmup, batch_tokens=a.batch_tokens,
                          max_seq_len=a.max_seq_len, fill_aug=a.fill_aug, fill_after_miss=a.fill_after_miss,
                          seed=a.seed, bf16=a.bf16,
                          save_every=a.save_every, weight_decay=a.weight_decay,
                          argmax_weight=a.argmax_weight, time_budget=a.time_budget)
        t0 = time.perf_counter()
        train(target, samples, out, a.num_stages, a.boundaries, a.anchors, a.draft_layers, a.draft_vocab, cfg,
              resume=not a.no_resume, log=log, feature_cache=not a.no_feature_cache, init=a.init,
              val_samples=val, train_lm_head=a.train_lm_head)
        log(json.dumps({"done": True, "seconds": round(time.perf_counter() - t0, 1), "head": str(out / "head")}))
    except SpdConfigError as e:
        msg = cli_message(e, build_parser())
        print(f"spd_fast.train: error: {msg}", file=sys.stderr)
        if log_f is not None:
            log_f.close()
            if created and [f.name for f in out.iterdir()] == ["train_log.jsonl"]:
                shutil.rmtree(out)  # a run refused before it wrote anything leaves no directory behind
            else:  # a run directory with history keeps the reason this attempt stopped
                with open(out / "train_log.jsonl", "a") as f:
                    f.write(json.dumps({"error": msg}) + "\n")
        return 2
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
