"""Model configuration: one frozen dataclass for every supported Llama-family architecture."""
from __future__ import annotations

import json
import math
import operator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

# model_type -> (qkv bias, q/k RMSNorm). Everything else is read from config.json.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),   # Llama 2 / 3.x, SmolLM2, Mistral-style dense llamas
    "qwen2": (True, False),    # Qwen2 / Qwen2.5: bias on q, k, v
    "qwen3": (False, True),    # Qwen3: RMSNorm on q and k per head
}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}


class RandomHeadWarning(UserWarning):
    """No draft head is shipped for this model and n: a random head drafts (the output is exact, but slow)."""


class SpdConfigError(ValueError):
    """A configuration or input the user can fix; the message says how."""


DEFAULT_LOOKUP = 3   # context lookup beside the PDM: match the 3 newest tokens (drafters.PdmDrafter)
MAX_LOOKUP = 64


def check_seed(seed: object, name: str = "seed") -> None:
    """An integer torch.Generator accepts."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SpdConfigError(f"{name} must be an integer, got {seed!r}")
    if not -2**63 <= seed < 2**64:
        raise SpdConfigError(f"{name} {seed} is out of range; use an integer in [-2**63, 2**64 - 1]")


def check_head_seed(seed: int, source: str) -> None:
    """load()'s `seed` makes a random head; refuse it for a head read from disk, where it would change nothing."""
    if seed != 0 and source != "random":
        raise SpdConfigError(f"seed={seed} seeds a random head, but this engine loads the head {source}, whose "
                             f"weights it cannot change; drop seed (sampling takes its seed in generate()), or pass "
                             f"draft='random'")


def check_lookup(lookup: object) -> int:
    """`lookup`: how many newest tokens a context match needs; 0 turns context lookup off."""
    if not isinstance(lookup, int) or isinstance(lookup, bool) or not 0 <= lookup <= MAX_LOOKUP:
        raise SpdConfigError(f"lookup must be an integer from 0 to {MAX_LOOKUP} (how many newest tokens a context "
                             f"match needs; 0 turns context lookup off, {DEFAULT_LOOKUP} is the default), "
                             f"got {lookup!r}")
    return lookup


@dataclass(frozen=True)
class ModelConfig:
    """A supported Llama-family model's architecture, read from its Hugging Face config.json (`from_dir`) or
    config dict (`from_hf_dict`); settings the model code lacks are refused there, not ignored."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise SpdConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> "ModelConfig":
        """The config of a Hugging Face config dict, checked: an unsupported architecture or setting is an error."""
        model_type = cfg.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
            raise SpdConfigError(
                f"unsupported model_type {model_type!r}; spd_fast supports "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3)")
        bias_default, qk_norm = SUPPORTED_ARCHITECTURES[model_type]
        missing = [k for k in _REQUIRED_HF_KEYS if cfg.get(k) is None]
        if missing:
            raise SpdConfigError(f"the model's config.json lacks {', '.join(missing)}; it is not a complete Hugging Face "
                                 f"{model_type} config (re-export the checkpoint with transformers' save_pretrained)")
        _check_hf_values(cfg)
        # settings the model code does not implement: refuse rather than load wrong logits silently
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' "swish" is SiLU
            raise SpdConfigError(f"unsupported hidden_act {act!r}: spd_fast's MLP is SwiGLU with SiLU, as in Llama, "
                                 f"SmolLM2 and Qwen; this checkpoint needs another activation")
        if cfg.get("mlp_bias"):
            raise SpdConfigError("unsupported mlp_bias=true: spd_fast's MLP projections have no bias; "
                                 "this checkpoint's MLP does")
        if model_type != "qwen2" and cfg.get("attention_bias"):
            raise SpdConfigError(f"unsupported attention_bias=true for {model_type}: it puts a bias on the q, k, v and "
                                 f"output projections, and spd_fast supports a q/k/v bias only (as Qwen2 has)")
        if cfg.get("use_sliding_window"):
            raise SpdConfigError("unsupported use_sliding_window=true: spd_fast attends over the whole context, so "
                                 "its output would differ from the model's past the window; set it to false in "
                                 "config.json only if the model was trained without it")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_theta, rope_scaling = _rope_settings(cfg)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise SpdConfigError(
                    f"unsupported rope_scaling type {kind!r}; supported: 'llama3' or none")
            if kind in ("default", None):
                rope_scaling = None
        return ModelConfig(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg["rms_norm_eps"] if cfg.get("rms_norm_eps") is not None else 1e-6,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v projections always have a bias in transformers, whatever attention_bias says
            attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", bias_default)),
            qk_norm=qk_norm,
            # a config without it gets transformers' default for its family (LlamaConfig 2048, Qwen 32768)
            max_position_embeddings=cfg.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type]),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @staticmethod
    def from_dir(path: str | Path) -> "ModelConfig":
        """The config of the checkpoint directory `path` (its config.json), as `from_hf_dict` reads it."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise SpdConfigError(f"{path} has no config.json; pass a Hugging Face checkpoint directory or a .gguf file")
        try:
            cfg = json.loads(p.read_text())
        except ValueError as e:
            raise SpdConfigError(f"{p} is not valid JSON ({e}); fix or re-export the checkpoint's config.json") from None
        if not isinstance(cfg, dict):
            raise SpdConfigError(f"{p} holds a {type(cfg).__name__}, not a JSON object; it is not a Hugging Face config")
        return ModelConfig.from_hf_dict(cfg)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (`eos_token_ids` as a list)."""
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d


def _rope_settings(cfg: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) as transformers reads them: version 5 takes `rope_scaling` if it is set,
    else `rope_parameters`, with the theta inside it before the top-level `rope_theta`; version 4 reads only
    `rope_scaling` and the top-level `rope_theta`. A config that the two versions would read differently is
    ambiguous, and refused rather than guessed."""
    top_theta = cfg.get("rope_theta")
    legacy = cfg.get("rope_scaling") or None
    params = cfg.get("rope_parameters") or None
    chosen = legacy or params or {}
    theta = chosen.get("rope_theta", top_theta)
    kind = chosen.get("rope_type", chosen.get("type", "default"))

    def fix(what: str) -> SpdConfigError:
        return SpdConfigError(f"config.json: {what}, and transformers 4 and 5 read these keys differently; keep one "
                              f"of them (or make them agree) so that the RoPE settings are unambiguous")

    if legacy and params:
        settings = [(d.get("rope_theta", top_theta), d.get("rope_type", d.get("type", "default")),
                     {k: v for k, v in d.items() if k not in ("rope_theta", "rope_type", "type")})
                    for d in (legacy, params)]
        if settings[0] != settings[1]:
            raise fix(f"rope_scaling {legacy} and rope_parameters {params} disagree")
    if top_theta is not None and theta is not None and float(theta) != float(top_theta):
        raise fix(f"rope_theta is {top_theta} but {'rope_scaling' if legacy else 'rope_parameters'} says "
                  f"rope_theta {theta}")
    return theta, (dict(chosen, rope_type=kind) if kind != "default" else None)


_REQUIRED_HF_KEYS = ("num_attention_heads", "hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers")
_POSITIVE_INT_HF_KEYS = _REQUIRED_HF_KEYS + ("num_key_value_heads", "head_dim", "max_position_embeddings")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check_hf_values(cfg: dict[str, Any]) -> None:
    """The values of a config.json that the model code reads, checked before anything is built: a wrong one
    would otherwise end in a ZeroDivisionError or a shape mismatch deep inside loading, or in the tokenizer's
    own config check, which names the wrong file."""
    def bad(key: str, want: str) -> SpdConfigError:
        return SpdConfigError(f"config.json: {key} must be {want}, got {cfg[key]!r}; fix it (or re-export the "
                              f"checkpoint with transformers' save_pretrained)")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for k in _POSITIVE_INT_HF_KEYS:
        if k in cfg and (cfg[k] is not None or k == "max_position_embeddings") and not (is_int(cfg[k]) and cfg[k] >= 1):
            raise bad(k, "a positive integer")
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv:
        raise SpdConfigError(f"config.json: num_key_value_heads ({kv}) must divide num_attention_heads ({heads}); fix "
                             f"it (or re-export the checkpoint with transformers' save_pretrained)")
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise SpdConfigError(f"config.json: num_attention_heads ({heads}) must divide hidden_size "
                             f"({cfg['hidden_size']}), or head_dim must be given; fix it")
    for k in ("rms_norm_eps", "rope_theta"):
        if cfg.get(k) is not None and not (is_number(cfg[k]) and cfg[k] > 0):
            raise bad(k, "a positive number")
    for k in ("rope_scaling", "rope_parameters"):
        v = cfg.get(k)
        if v is not None and not isinstance(v, dict):
            raise bad(k, "an object (or null)")
        if isinstance(v, dict) and "rope_theta" in v and not (is_number(v["rope_theta"]) and v["rope_theta"] > 0):
            raise SpdConfigError(f"config.json: {k}.rope_theta must be a positive number, got {v['rope_theta']!r}; "
                                 f"fix it (or re-export the checkpoint with transformers' save_pretrained)")
        if isinstance(v, dict) and v.get("rope_type", v.get("type")) == "llama3":
            missing = [x for x in _LLAMA3_ROPE_KEYS if not is_number(v.get(x))]
            if missing:
                raise SpdConfigError(f"config.json: {k} of type 'llama3' needs the numbers {', '.join(missing)}; "
                                     f"fix it (or re-export the checkpoint with transformers' save_pretrained)")
    eos = cfg.get("eos_token_id")
    if eos is not None and not (is_int(eos) or (isinstance(eos, list) and all(map(is_int, eos)))):
        raise bad("eos_token_id", "a token id or a list of token ids")
    if cfg.get("bos_token_id") is not None and not is_int(cfg["bos_token_id"]):
        raise bad("bos_token_id", "a token id")


def check_layer_indices(values: Any, what: str, example: list[int]) -> tuple[int, ...]:
    """A sequence of integer layer indices (stage boundaries, anchors) as a tuple, or a clear error; no silent
    int(2.7) == 2."""
    try:
        return tuple(operator.index(x) for x in values)
    except TypeError:
        raise SpdConfigError(f"{what} must be a sequence of integer layer indices, got {values!r} "
                             f"(e.g. {example})") from None


def uniform_boundaries(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Stage boundaries c_0=0 < c_1 < ... < c_n=L, the layers split as evenly as possible."""
    validate_num_stages(num_layers, num_stages)
    return tuple(round(s * num_layers / num_stages) for s in range(num_stages + 1))


def validate_num_stages(num_layers: int, num_stages: int) -> None:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise SpdConfigError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > num_layers:
        raise SpdConfigError(
            f"num_stages={num_stages} exceeds the model's {num_layers} layers; use 1 <= num_stages <= {num_layers}")


def check_stage_count(num_stages: Any, boundaries: Sequence[int]) -> None:
    """num_stages, when given beside boundaries, must be the number of stages they make."""
    if num_stages is not None and num_stages != len(boundaries) - 1:
        raise SpdConfigError(f"num_stages={num_stages!r} disagrees with boundaries {list(boundaries)}, which make "
                             f"{len(boundaries) - 1} stages; pass only one of them")


def validate_boundaries(boundaries: tuple[int, ...] | list[int], num_layers: int) -> tuple[int, ...]:
    n = len(boundaries) - 1 if isinstance(boundaries, (list, tuple)) and len(boundaries) >= 2 else 3
    example = list(uniform_boundaries(num_layers, max(1, min(n, num_layers))))  # with as many stages as asked
    b = check_layer_indices(boundaries, "stage boundaries", example)
    if len(b) < 2 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in zip(b, b[1:])):
        raise SpdConfigError(
            f"stage boundaries {list(b)} are invalid: they must start at 0, end at num_layers={num_layers} "
            f"and strictly increase (e.g. {example})")
    return b
