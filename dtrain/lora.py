"""LoRA layers (from mlx-lm) and the adapter folder mlx-lm reads.

The adapter format is mlx-lm's (``mlx_lm/tuner/utils.py: load_adapters``):
``adapters.safetensors`` with the ``lora_a``/``lora_b`` tensors under their
module paths, and ``adapter_config.json`` with ``fine_tune_type``,
``num_layers`` and ``lora_parameters`` — so ``mlx_lm.generate --adapter-path``
and ``mlx_lm.fuse`` take it as is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from .config import LoraConfig
from .errors import ConfigError
from .files import fsync_path

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def lora_parameters(cfg: LoraConfig) -> dict:
    """The ``lora_parameters`` mapping mlx-lm expects."""
    params = {"rank": cfg.rank, "scale": cfg.scale, "dropout": cfg.dropout}
    if cfg.keys is not None:
        params["keys"] = list(cfg.keys)
    return params


def apply_lora(model: nn.Module, cfg: LoraConfig) -> int:
    """Freeze ``model`` and wrap its linear layers in mlx-lm LoRA layers.

    Relies on ``linear_to_lora_layers``: LoRA on the last ``num_layers``
    decoder layers (all when -1), on the module keys given or every linear
    layer. ``lora_b`` starts at zero (mlx-lm), so the model is unchanged.

    Returns:
        The number of trainable parameters.
    Raises:
        ConfigError: no module matched ``lora.keys``.
    """
    n_layers = len(model.layers)
    num_layers = n_layers if cfg.num_layers < 0 else min(cfg.num_layers, n_layers)
    model.freeze()
    linear_to_lora_layers(model, num_layers, lora_parameters(cfg))
    count = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    if count == 0:
        raise ConfigError(f"lora.keys {cfg.keys!r} matched no linear layer of the model")
    return count


def adapter_config(cfg: LoraConfig, model: nn.Module) -> dict:
    n_layers = len(model.layers)
    num_layers = n_layers if cfg.num_layers < 0 else min(cfg.num_layers, n_layers)
    return {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": lora_parameters(cfg)}


def save_adapter(model: nn.Module, cfg: LoraConfig, out_dir: str | Path, extra: dict | None = None) -> Path:
    """Write the adapter folder atomically (temporary folder, fsync, rename).

    Args:
        model: model with LoRA layers.
        cfg: the LoRA config it was built with.
        out_dir: destination folder; replaced as a whole if it exists.
        extra: more keys for ``adapter_config.json`` (e.g. the base model).
    Returns:
        ``out_dir`` as a Path.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(tmp / ADAPTER_WEIGHTS), weights)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps({**adapter_config(cfg, model), **(extra or {})}, indent=2))
    for f in tmp.iterdir():
        fsync_path(f)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    fsync_path(out.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    return out
