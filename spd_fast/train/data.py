"""Training data: prompt sets, self-distillation with the runtime's batched generation, local files."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..batch_generate import generate_batch
from ..progress import bar
from ..runtime import Target
from ..sampling import SamplingParams

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a .jsonl file, or of a gzip-compressed .jsonl.gz one."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_prompts(path: str | Path | None = None) -> list[dict]:
    """{"id", "prompt"} records; default: the project's training prompt set."""
    return read_jsonl(path or PROMPTS_DIR / "train.jsonl")


def self_distill(target: Target, prompts: list[dict], out_path: str | Path, max_new_tokens: int = 128,
                 batch_size: int = 32, temperature: float = 0.0, seed: int = 0, progress: bool = True) -> Path:
    """Let the target answer every prompt; append {"id", "prompt_ids", "response_ids"} lines to out_path.

    Resumable: prompts whose id is already in out_path are skipped.
    """
    out_path = Path(out_path)
    done = {r["id"] for r in read_jsonl(out_path)} if out_path.is_file() else set()
    todo = [p for p in prompts if p["id"] not in done]
    enc = [(p["id"], target.encode([{"role": "user", "content": p["prompt"]}])) for p in todo]
    enc.sort(key=lambda x: len(x[1]))  # similar lengths batch together
    params = SamplingParams(temperature=temperature, seed=seed)
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    longest = max((len(e) for _, e in enc), default=0)
    target.model.setup_caches(batch_size, longest + max_new_tokens + 1)
    batches = [enc[i:i + batch_size] for i in range(0, len(enc), batch_size)]
    with open(out_path, "a") as f:
        for batch in bar(batches, "self-distillation", enabled=progress):
            outs = generate_batch(target.model, [e for _, e in batch], max_new_tokens, params, target.eos_ids, gen)
            for (pid, e), o in zip(batch, outs):
                f.write(json.dumps({"id": pid, "prompt_ids": e, "response_ids": o}) + "\n")
            f.flush()
    return out_path


def chat_user_prefix(target: Target) -> list[int]:
    """Token ids of the chat template up to the point where the user's message starts (with the
    template's default system prompt, if it has one)."""
    mark = "\u2063XYZ\u2063"
    full = target.encode([{"role": "user", "content": mark}])
    text = target.tokenizer.decode(full)
    ids = target.tokenizer.encode(text[: text.index(mark)], add_special_tokens=False)
    if ids != full[: len(ids)]:
        raise ValueError("the chat template's text before the user message does not tokenize on its own; "
                         "self-written prompts need a template whose user turn starts at a token boundary")
    return ids


def plausible_prompt(text: str, n_tokens: int, min_tokens: int = 4, min_ascii: float = 0.97) -> bool:
    """Filter for self-written prompts: long enough and (nearly) all ASCII (a 135M model sampling at
    temperature 1 sometimes drifts into garbled non-English text)."""
    if n_tokens < min_tokens or not text.strip():
        return False
    return sum(c.isascii() for c in text) / len(text) > min_ascii


@torch.inference_mode()
def self_written_prompts(target: Target, openers: list[str], max_tokens: int = 64,
                         generator: torch.Generator | None = None) -> list[tuple[int, str]]:
    """Let the target write user messages (the "Magpie" recipe): the chat template up to the user
    turn, plus an opener per row ("" = none), sampled at temperature 1.0 / top-p 0.95 until the
    end-of-turn token. Returns (row, message) for the rows that ended within max_tokens and pass
    `plausible_prompt`; the message starts with the row's opener."""
    tok = target.tokenizer
    prefix = chat_user_prefix(target)
    starts = [prefix + (tok.encode(o, add_special_tokens=False) if o else []) for o in openers]
    users = generate_batch(target.model, starts, max_tokens, SamplingParams(temperature=1.0, top_p=0.95),
                           target.eos_ids, generator)
    out = []
    for i, (o, u) in enumerate(zip(openers, users)):
        if not u or u[-1] not in target.eos_ids:
            continue  # ran out of tokens mid-message
        text = tok.decode((tok.encode(o, add_special_tokens=False) if o else []) + u[:-1]).strip()
        if plausible_prompt(text, len(u)):
            out.append((i, text))
    return out


def text_file_samples(path: str | Path, target: Target) -> Iterator[dict]:
    """Local data: .jsonl with {"messages": [...]} (chat; loss on assistant turns) or {"text": ...},
    or a plain .txt file (one sample per blank-line-separated block). A .jsonl.gz file is read as .jsonl;
    other compressed files are refused."""
    from ..config import SpdConfigError

    path = Path(path)
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        stem = path.name.removesuffix(".gz").removesuffix(".jsonl")
        for i, rec in enumerate(read_jsonl(path)):
            if "prompt_ids" in rec:
                yield rec
            elif "messages" in rec:
                msgs = rec["messages"]
                ids_prompt = target.tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True)
                ids_full = target.tokenizer.apply_chat_template(msgs, tokenize=True)
                ids_prompt = list(ids_prompt["input_ids"] if isinstance(ids_prompt, dict) else ids_prompt)
                ids_full = list(ids_full["input_ids"] if isinstance(ids_full, dict) else ids_full)
                yield {"id": f"{stem}-{i}", "prompt_ids": ids_prompt, "response_ids": ids_full[len(ids_prompt):]}
            elif "text" in rec:
                yield {"id": f"{stem}-{i}", "prompt_ids": [], "response_ids": target.tokenizer.encode(rec["text"])}
    elif path.suffix in (".gz", ".bz2", ".xz", ".zst", ".zip"):
        raise SpdConfigError(f"data file {path}: only .jsonl.gz is read compressed; decompress it first "
                             "(or gzip a .jsonl file)")
    elif path.suffix == ".parquet":
        import pandas as pd  # optional: only needed for parquet input

        for i, text in enumerate(pd.read_parquet(path)["text"]):
            yield {"id": f"{path.stem}-{i}", "prompt_ids": [], "response_ids": target.tokenizer.encode(text)}
    else:
        for i, block in enumerate(b for b in path.read_text().split("\n\n") if b.strip()):
            yield {"id": f"{path.stem}-{i}", "prompt_ids": [], "response_ids": target.tokenizer.encode(block)}


def read_val_samples(paths: Sequence[str | Path], target: Target) -> list[dict]:
    """Held-out samples from the given files (any format text_file_samples reads), in order."""
    from ..config import SpdConfigError

    out: list[dict] = []
    for src in paths:
        if not Path(src).is_file():
            raise SpdConfigError(f"validation file {src} does not exist")
        out += list(text_file_samples(src, target))
    return out
