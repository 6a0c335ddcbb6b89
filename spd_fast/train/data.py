"""Training data: prompt sets, self-distillation with the runtime's batched generation, local files."""
from __future__ import annotations

import contextlib
import gzip
import json
import re
import sys
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..batch_generate import generate_batch
from ..config import SpdConfigError
from ..progress import bar
from ..runtime import CHAT_ROLES, Target, chat_ids, check_text, model_identity
from ..sampling import SamplingParams
from ..store import write_text_durably

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a .jsonl file, or of a gzip-compressed .jsonl.gz one. A line that is not a JSON object is an
    error naming the file and line."""
    opener = gzip.open if str(path).lower().endswith(".gz") else open
    rows = []
    with _readable(path):
        with opener(path, "rt", encoding="utf-8-sig") as f:  # -sig: a leading byte-order mark is not data
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's depth limit
                    raise SpdConfigError(f"{path}, line {n}: not valid JSON ({e}); each line of a .jsonl file must "
                                         f"be one JSON object") from None
                if not isinstance(row, dict):
                    raise SpdConfigError(f"{path}, line {n}: a JSON {type(row).__name__}, not an object; each line "
                                         f"of a .jsonl file must be one JSON object")
                rows.append(row)
    return rows


@contextlib.contextmanager
def _readable(path: str | Path) -> Iterator[None]:
    """Turn a file that cannot be read as text (not UTF-8, a broken .gz) into one line naming it."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise SpdConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise SpdConfigError(f"{path} is not a complete gzip file ({e}); recompress it, or drop the .gz suffix "
                             f"if it is plain text") from None
    except IsADirectoryError:
        raise SpdConfigError(f"{path} is a directory; pass a data file") from None


def _drop_partial_line(path: Path) -> None:
    """Cut a self-distillation file back to its last complete line: a run killed while writing an answer leaves
    half a JSON line, which the resumed run would otherwise refuse (or glue its next answer onto)."""
    with open(path, "rb+") as f:
        size = f.seek(0, 2)
        if not size:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        keep, pos = 0, size
        while pos > 0 and not keep:  # the last newline, read backwards in 64 KiB blocks
            step = min(pos, 1 << 16)
            pos -= step
            f.seek(pos)
            cut = f.read(step).rfind(b"\n")
            if cut >= 0:
                keep = pos + cut + 1
        f.truncate(keep)
    print(f"self-distillation: dropped a partial last line of {path} ({size - keep} bytes; a run stopped while "
          f"writing it), and go on from the answers before it", file=sys.stderr)


def check_token_ids(ids: object, vocab_size: int | None, where: str, key: str) -> list[int]:
    """A list of this model's token ids (integers 0..vocab_size-1, or >= 0 when vocab_size is None; no floats
    or booleans)."""
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise SpdConfigError(f"{where}: \"{key}\" must be a list of integer token ids")
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        span = f"0..{vocab_size - 1}" if vocab_size is not None else "ids are >= 0"
        raise SpdConfigError(f"{where}: \"{key}\" holds {bad}, not a token id of this model ({span}); "
                             f"make the ids with this model's tokenizer")
    return ids


def load_prompts(path: str | Path | None = None) -> list[dict]:
    """{"id", "prompt"} records; default: the project's training prompt set."""
    path = Path(path) if path else PROMPTS_DIR / "train.jsonl"
    if path.is_dir():
        raise SpdConfigError(f"prompt file {path} is a directory; pass a .jsonl file of {{\"id\", \"prompt\"}} rows")
    if not path.is_file():
        raise SpdConfigError(f"prompt file {path} does not exist; pass a .jsonl file of {{\"id\", \"prompt\"}} rows")
    rows = read_jsonl(path)
    if not rows:
        raise SpdConfigError(f"prompt file {path} holds no prompts; pass a .jsonl file of {{\"id\", \"prompt\"}} rows")
    seen: dict = {}
    for n, r in enumerate(rows, 1):
        if not isinstance(r.get("prompt"), str) or "id" not in r:
            raise SpdConfigError(f"{path}, row {n}: a prompt row needs an \"id\" and a string \"prompt\", got keys "
                                 f"{sorted(r)}")
        if not isinstance(r["id"], (str, int)) or isinstance(r["id"], bool):
            raise SpdConfigError(f"{path}, row {n}: \"id\" must be a string or an integer, got {r['id']!r}")
        check_text(r["prompt"], f"{path}, row {n}: the prompt")
        if r["id"] in seen:
            raise SpdConfigError(f"{path}, rows {seen[r['id']]} and {n} share the id {r['id']!r}; give each prompt "
                                 f"its own id (answers are kept by id)")
        seen[r["id"]] = n
    return rows


def self_distill(target: Target, prompts: list[dict], out_path: str | Path, max_new_tokens: int = 128,
                 batch_size: int = 32, temperature: float = 0.0, seed: int = 0, progress: bool = True) -> Path:
    """Let the target answer every prompt; append {"id", "prompt_ids", "response_ids"} lines to out_path.

    Resumable: prompts whose id is already in out_path are skipped. A sidecar OUT.meta.json records the
    settings; answers made with others (another model, max_new_tokens, temperature or seed), or to another
    prompt under the same id, are an error rather than silently reused.
    """
    out_path = Path(out_path)
    meta_path = out_path.with_name(out_path.name + ".meta.json")
    meta = {"fingerprint": target.fingerprint, "model_identity": model_identity(target.model),
            "dtype": str(target.model.embed.weight.dtype).removeprefix("torch."),  # part of the identity, named
            "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    if out_path.is_file():
        _drop_partial_line(out_path)
    rows = read_jsonl(out_path) if out_path.is_file() else []
    if getattr(target.tokenizer, "chat_template", None) is None:
        raise SpdConfigError(f"self-distillation asks the model its prompts as chat messages, and the tokenizer in "
                             f"{target.path} has no chat template (a base model?); train on text instead: --data "
                             f"FILE with .txt or {{\"text\"}} .jsonl rows")
    if rows and meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except ValueError:
            raise SpdConfigError(f"{meta_path} (the settings of the answers in {out_path.name}) is unreadable; "
                                 f"delete both files to make new answers, or use another --out") from None
        # a sidecar written before model_identity existed is checked on the rest (its sampled fingerprint); greedy
        # answers do not depend on the seed (no generator draws them), so another --seed reuses them
        diff = [f"{k} {old.get(k)!r} vs {v!r}" for k, v in meta.items()
                if old.get(k) != v and not (k in ("model_identity", "dtype") and k not in old)
                and not (k == "seed" and temperature == 0 and old.get("temperature") == 0)]
        if diff:
            raise SpdConfigError(f"{out_path} holds answers made with other settings ({'; '.join(diff)}); delete it "
                                 f"(and {meta_path.name}) to make new ones, or use another --out")
    write_text_durably(meta_path, json.dumps(meta))  # a kill mid-write must not leave a truncated file
    done = {r["id"]: r["prompt_ids"] for r in rows}
    encoded = {p["id"]: target.encode([{"role": "user", "content": p["prompt"]}]) for p in prompts}
    stale = [i for i, ids in encoded.items() if i in done and done[i] != ids]
    if stale:
        raise SpdConfigError(f"{out_path} answers prompt id {stale[0]!r} for another prompt text; delete it to "
                             f"answer this prompt set, or use another --out")
    enc = [(i, ids) for i, ids in encoded.items() if i not in done]
    enc.sort(key=lambda x: len(x[1]))  # similar lengths batch together
    params = SamplingParams(temperature=temperature, seed=seed)
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    if not enc:
        return out_path
    longest = max(len(e) for _, e in enc)
    target.model.setup_caches(batch_size, longest + max_new_tokens + 1)
    batches = [enc[i:i + batch_size] for i in range(0, len(enc), batch_size)]
    try:
        with open(out_path, "a") as f:
            for batch in bar(batches, "self-distillation", enabled=progress):
                outs = generate_batch(target.model, [e for _, e in batch], max_new_tokens, params, target.eos_ids,
                                      gen)
                for (pid, e), o in zip(batch, outs):
                    f.write(json.dumps({"id": pid, "prompt_ids": e, "response_ids": o}) + "\n")
                f.flush()
    finally:  # sized for generation (batch x longest answer): the teacher passes after this size their own
        target.model.free_caches()
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
    special = set(tok.all_special_ids)
    for i, (o, u) in enumerate(zip(openers, users)):
        if not u or u[-1] not in target.eos_ids:
            continue  # ran out of tokens mid-message
        if special & set(u[:-1]):  # e.g. <|im_start|>assistant: decoded as text, the chat template would re-encode
            continue               # it as a real special token, a made-up turn inside the prompt
        text = tok.decode((tok.encode(o, add_special_tokens=False) if o else []) + u[:-1]).strip()
        if plausible_prompt(text, len(u)):
            out.append((i, text))
    return out


DATA_FORMATS = ".jsonl, .jsonl.gz, .json (a list of rows), .parquet (a \"text\" column) or .txt"
ROW_KEYS = '"messages" (chat), "text", or "prompt_ids" + "response_ids" (token ids)'


def _model_ids(ids: list[int], target: Target, where: str) -> list[int]:
    """Ids the tokenizer made, checked against the model's vocabulary (a tokenizer of another model would
    otherwise fail deep inside training with an index error)."""
    bad = next((t for t in ids if not 0 <= t < target.cfg.vocab_size), None)
    if bad is not None:
        raise SpdConfigError(f"{where}: the tokenizer in {target.path} made token id {bad}, outside the model's "
                             f"vocabulary (0..{target.cfg.vocab_size - 1}), so it does not match the model; put "
                             f"the model's own tokenizer files there")
    return ids


OPENING_TURN = "opening assistant turn"  # a chat's first message, with nothing before it to be its prompt


def _encode_text(text: str, target: Target, where: str) -> list[int]:
    """A text sample's ids (loss on all of it), its text checked first (a lone surrogate named, not the
    tokenizer's TypeError)."""
    check_text(text, f"{where}: the text")
    return _model_ids(target.tokenizer.encode(text), target, where)


def _answer_ids(ids: list[int], eos_ids: Sequence[int]) -> list[int]:
    """An assistant turn's ids up to its end-of-turn token: what the template adds after it (a newline) is never
    decoded, since generation stops at that token, so no loss is taken there."""
    ends = [k for k, t in enumerate(ids) if t in eos_ids]
    return ids[: ends[-1] + 1] if ends else ids


def row_samples(rec: dict, where: str, stem: str, i: int, target: Target | None) -> Iterator[dict]:
    """The training samples of one data row: token ids as they are; a chat (one sample per assistant turn,
    the loss on that turn up to its end-of-turn token, the conversation before it as the prompt); or plain
    text (loss on all of it)."""
    vocab = target.cfg.vocab_size if target is not None else None  # None: token-id rows read without a model
    if "prompt_ids" in rec:
        if not isinstance(rec.get("response_ids"), list) or not isinstance(rec["prompt_ids"], list):
            raise SpdConfigError(f"{where}: \"prompt_ids\" and \"response_ids\" must both be lists of token ids")
        check_token_ids(rec["prompt_ids"], vocab, where, "prompt_ids")
        check_token_ids(rec["response_ids"], vocab, where, "response_ids")
        yield rec if "id" in rec else dict(rec, id=f"{stem}-{i}")
    elif "messages" in rec:
        msgs = rec["messages"]
        if (not isinstance(msgs, list) or not msgs
                or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                           and isinstance(m.get("role"), str) for m in msgs)):
            raise SpdConfigError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects "
                                 f"with string values")
        for k, m in enumerate(msgs):  # a mis-cased "Assistant" would otherwise be context with no loss, unsaid
            if m["role"] not in CHAT_ROLES:
                raise SpdConfigError(f"{where}: message {k + 1} has role {m['role']!r}; use one of "
                                     + ", ".join(repr(r) for r in CHAT_ROLES))
            check_text(m["content"], f"{where}: the content of message {k + 1}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise SpdConfigError(f"{where}: the chat has no assistant message, so there is nothing to train on; the "
                                 f"loss is taken on assistant turns")
        if msgs[0]["role"] == "assistant":  # no conversation before it: chat templates refuse an empty one as the
            # prompt, so it is not trained on; an empty answer that says why (the train command counts them)
            yield {"id": f"{stem}-{i}-opening", "prompt_ids": [], "response_ids": [], "skipped": OPENING_TURN}
        turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant" and k > 0]
        if turns and getattr(target.tokenizer, "chat_template", None) is None:
            raise SpdConfigError(f"{where}: a chat row, and the tokenizer in {target.path} has no chat template (a "
                                 f"base model?), so its turns cannot be laid out as the model reads them; train on "
                                 f"text instead: .txt or {{\"text\"}} .jsonl rows")
        for j, k in enumerate(turns):
            try:
                prompt = chat_ids(target.tokenizer, msgs[:k])
                full = chat_ids(target.tokenizer, msgs[: k + 1], add_generation_prompt=False)
            except Exception as e:  # jinja's errors: a template that refuses these roles or this order
                raise SpdConfigError(f"{where}: the model's chat template rejects these messages "
                                     f"({type(e).__name__}: {e}); fix the roles or order, or use \"text\" rows") from None
            if full[: len(prompt)] != prompt:
                raise SpdConfigError(f"{where}: the chat template does not extend the conversation's tokens when "
                                     f"a turn is added, so the assistant turn cannot be cut out; use \"text\" rows")
            yield {"id": f"{stem}-{i}" + (f"-{j}" if len(turns) > 1 else ""), "prompt_ids": prompt,
                   "response_ids": _answer_ids(_model_ids(full, target, where)[len(prompt):], target.eos_ids)}
    elif isinstance(rec.get("text"), str):
        yield {"id": f"{stem}-{i}", "prompt_ids": [], "response_ids": _encode_text(rec["text"], target, where)}
    elif "text" in rec:
        raise SpdConfigError(f"{where}: \"text\" must be a string, got {rec['text']!r}")
    else:
        raise SpdConfigError(f"{where}: a row needs {ROW_KEYS}; got keys {sorted(rec)}")


def text_file_samples(path: str | Path, target: Target | None) -> Iterator[dict]:
    """Local data: .jsonl (or .jsonl.gz, or a .json list) of rows with {"messages": [...]} (chat; loss on the
    assistant turns), {"text": ...} or {"prompt_ids", "response_ids"}; .parquet with a "text" column; or a
    plain .txt file (one sample per blank-line-separated block). Suffixes are matched in any case; other
    compressed files and unknown suffixes are refused. `target` may be None for token-id rows only (their ids
    are then checked to be integers >= 0, not against a vocabulary)."""
    path = Path(path)
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json")):
        stem = path.name[: -len(".jsonl.gz")] if name.endswith(".gz") else path.name.rsplit(".", 1)[0]
        if name.endswith(".json"):
            with _readable(path):
                text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is not data
            try:
                rows = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise SpdConfigError(f"{path}: not valid JSON ({e}); a .json data file holds one list of rows "
                                     f"(or use .jsonl, one row per line)") from None
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise SpdConfigError(f"{path}: a .json data file must hold a list of JSON objects (rows)")
        else:
            rows = read_jsonl(path)
        for i, rec in enumerate(rows):
            yield from row_samples(rec, f"{path}, row {i + 1}", stem, i, target)
    elif path.suffix.lower() in (".gz", ".bz2", ".xz", ".zst", ".zip"):
        raise SpdConfigError(f"data file {path}: only .jsonl.gz is read compressed; decompress it first "
                             "(or gzip a .jsonl file)")
    elif path.suffix.lower() == ".parquet":
        try:
            import pandas as pd  # optional: only needed for parquet input
        except ImportError:
            raise SpdConfigError(f"data file {path}: reading .parquet needs pandas and pyarrow "
                                 f"(pip install pandas pyarrow), or convert it to .jsonl") from None
        try:
            frame = pd.read_parquet(path)
        except ImportError as e:  # pandas without a parquet engine
            raise SpdConfigError(f"data file {path}: reading .parquet needs pyarrow (pip install pyarrow), or "
                                 f"convert it to .jsonl ({e})") from None
        except Exception as e:  # pyarrow's ArrowInvalid and friends: not a parquet file, or a damaged one
            raise SpdConfigError(f"data file {path} cannot be read as parquet ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}); pass a valid .parquet file, or "
                                 f"rename it if it holds another format") from None
        if "text" not in frame.columns:
            raise SpdConfigError(f"data file {path}: a .parquet file needs a \"text\" column; it has "
                                 f"{list(frame.columns)}")
        for i, text in enumerate(frame["text"]):
            if not isinstance(text, str):
                raise SpdConfigError(f"data file {path}, row {i + 1}: the \"text\" column holds {text!r}, not a "
                                     f"string; drop or fill the empty rows")
            yield {"id": f"{path.stem}-{i}", "prompt_ids": [],
                   "response_ids": _encode_text(text, target, f"data file {path}, row {i + 1}")}
    elif path.suffix.lower() in (".txt", ".text", ".md", ""):
        with _readable(path):
            text = path.read_text(encoding="utf-8-sig")
        # blocks end at a blank line, one of spaces or tabs too (it looks blank)
        for i, block in enumerate(b for b in re.split(r"\n[ \t]*\n", text) if b.strip()):
            yield {"id": f"{path.stem}-{i}", "prompt_ids": [], "response_ids": _encode_text(block, target,
                                                                                           f"{path}, block {i + 1}")}
    else:
        raise SpdConfigError(f"data file {path}: unknown format {path.suffix!r}; use {DATA_FORMATS}")


def read_val_samples(paths: Sequence[str | Path], target: Target) -> list[dict]:
    """Held-out samples from the given files (any format text_file_samples reads), in order."""
    out: list[dict] = []
    for src in paths:
        if not Path(src).is_file():
            raise SpdConfigError(f"validation file {src} " + ("is a directory; pass a file" if Path(src).is_dir()
                                                                else "does not exist"))
        out += list(text_file_samples(src, target))
    return out
