"""LoRA layers (from mlx-lm), their dropout keys, and the adapter folder mlx-lm reads.

The adapter format is mlx-lm's (``mlx_lm/tuner/utils.py: load_adapters``):
``adapters.safetensors`` with the ``lora_a``/``lora_b`` tensors under their
module paths, and ``adapter_config.json`` with ``fine_tune_type``,
``num_layers`` and ``lora_parameters`` — so ``mlx_lm.generate --adapter-path``
and ``mlx_lm.fuse`` take it as is.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers

from .config import LoraConfig
from .config_checks import checked
from .errors import TOO_DEEP, ConfigError
from .files import OutputDir, atomic_folder, home_path, storage

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def lora_scale(cfg: LoraConfig) -> float:
    """The scale the LoRA layers use: ``scale``, or ``scale / sqrt(rank)`` with ``rslora``
    (Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA": gamma = alpha / sqrt(r))."""
    return cfg.scale / math.sqrt(cfg.rank) if cfg.rslora else cfg.scale


def lora_parameters(cfg: LoraConfig) -> dict:
    """The ``lora_parameters`` mapping mlx-lm expects (the scale the layers use, :func:`lora_scale`)."""
    params = {"rank": cfg.rank, "scale": lora_scale(cfg), "dropout": cfg.dropout}
    if cfg.keys is not None:
        params["keys"] = list(cfg.keys)
    return params


class BranchLoRALinear(LoRALinear):
    """mlx-lm's ``LoRALinear`` whose low-rank product runs in the activations' dtype on a
    bfloat16 model (``lora.branch_dtype: bfloat16``, ``auto``'s choice there).

    mlx-lm keeps ``lora_a``/``lora_b`` in float32, so on a bfloat16 model ``x @ lora_a``
    promotes ``x`` and the ``(tokens, out)`` product, its scaling and their gradients run in
    float32: most of a LoRA step's time beside the base model's matmuls (docs/benchmarks.md).
    Here the factors are cast to bfloat16 for the product (``scale`` folded into ``lora_b``),
    as PyTorch autocast runs PEFT's LoRA layers; the parameters, their gradients (the casts'
    vjp) and AdamW stay float32. Other input dtypes (float32; float16, whose range is why
    half-precision training scales its loss) take mlx-lm's path unchanged. Same parameters,
    ``fuse`` and adapter files as ``LoRALinear``.
    """

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.bfloat16 or self.lora_a.dtype == mx.bfloat16:
            return super().__call__(x)
        lora_b = (self.scale * self.lora_b).astype(x.dtype)
        return self.linear(x) + (self.dropout(x) @ self.lora_a.astype(x.dtype)) @ lora_b


def apply_lora(model: nn.Module, cfg: LoraConfig, keys_from: str = "lora.keys") -> int:
    """Freeze ``model`` and wrap its linear layers in mlx-lm LoRA layers.

    Relies on ``linear_to_lora_layers``: LoRA on the last ``num_layers``
    decoder layers (all when -1), on the module keys given or every linear
    layer. ``lora_b`` starts at zero (mlx-lm), so the model is unchanged.
    With ``branch_dtype`` ``bfloat16`` (or ``auto``) each ``LoRALinear`` becomes a
    :class:`BranchLoRALinear` (the same module, its class changed).

    Returns:
        The number of trainable parameters.
    Raises:
        ConfigError: a key that names no module of the model, no module matched ``lora.keys``, or one
            that is not a linear layer (named as ``keys_from``: where the keys came from, e.g. an initial
            adapter's ``adapter_config.json``).
    """
    n_layers = len(model.layers)
    num_layers = n_layers if cfg.num_layers < 0 else min(cfg.num_layers, n_layers)
    check_keys(model, cfg.keys, keys_from)
    model.freeze()
    try:
        linear_to_lora_layers(model, num_layers, lora_parameters(cfg))
    except ValueError as err:  # mlx-lm's "Can't convert layer of type RMSNorm to LoRA"
        raise ConfigError(f"{keys_from} {cfg.keys!r}: {err}; name linear layers, e.g. [self_attn.q_proj, "
                          "mlp.down_proj]") from None
    if cfg.branch_dtype in ("auto", "bfloat16"):
        for _, module in model.named_modules():
            if type(module) is LoRALinear:
                module.__class__ = BranchLoRALinear
    count = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    if count == 0:
        where = "the model" if num_layers >= n_layers else \
            f"the last {num_layers} of the model's {n_layers} decoder layers (num_layers {num_layers})"
        raise ConfigError(f"{keys_from} {cfg.keys!r} matched no linear layer of {where}")
    return count


def check_keys(model: nn.Module, keys: list | None, keys_from: str) -> None:
    """Refuse ``keys`` that name no module of a decoder layer nor of the model (mlx-lm matches keys against
    both and drops a key that matches nothing without a word, so a typo would train the other keys only).

    Raises:
        ConfigError: naming the unknown keys and the decoder layers' linear layers.
    """
    names = {k for layer in model.layers for k, _ in layer.named_modules()} | {k for k, _ in model.named_modules()}
    unknown = [k for k in keys or () if not isinstance(k, str) or k not in names]  # an adapter's keys may be anything
    if unknown:
        linear = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear)
        known = sorted({k for layer in model.layers for k, m in layer.named_modules() if isinstance(m, linear)})
        raise ConfigError(f"{keys_from} {keys!r}: no module named {', '.join(map(repr, unknown))}; the decoder "
                          f"layers' linear layers are {', '.join(known)}")


class DropoutKeys:
    """The explicit key stream LoRA dropout draws from (never MLX's global generator).

    An engine sets ``key`` (an ``mx.random.key``) before it runs layers; each
    dropout call splits it and draws its mask with one half, so the masks are a
    function of the key and the order of the calls. Setting the same key again
    replays the same masks (a layer range recomputed under ``mx.vjp``).
    """

    def __init__(self):
        self.key = None

    def next(self) -> mx.array:
        """A fresh key for one dropout mask; advances ``key``.

        Raises:
            ValueError: no key was set (an engine step called without ``key``).
        """
        if self.key is None:
            raise ValueError("LoRA dropout is on but no key was given: pass key=mx.random.key(...) to the "
                             "engine's step or evaluate")
        self.key, sub = mx.random.split(self.key)
        return sub


class KeyedDropout(nn.Dropout):
    """``nn.Dropout`` whose masks come from a :class:`DropoutKeys` stream; the same
    scaling as ``nn.Dropout`` (kept values times ``1 / (1 - p)``)."""

    def __init__(self, p: float, keys: DropoutKeys):
        super().__init__(p)
        self.stream = keys  # not an array: a plain attribute, not a parameter

    def __call__(self, x: mx.array) -> mx.array:
        if self._p_1 == 1 or not self.training:
            return x
        mask = mx.random.bernoulli(self._p_1, x.shape, key=self.stream.next())
        return (mask * x) * (1 / self._p_1)


def keyed_dropout(model: nn.Module) -> DropoutKeys | None:
    """Give every active dropout of ``model`` (mlx-lm's LoRA dropout) one shared key stream.

    Replaces each ``nn.Dropout`` with ``p > 0`` by a :class:`KeyedDropout` (the
    module instance, not its class); already keyed ones keep their stream.
    Called by the engines; idempotent.

    Returns:
        The stream, or None when the model has no active dropout.
    """
    found = [(parent, k, v) for _, parent in model.named_modules() for k, v in parent.items()
             if isinstance(v, nn.Dropout) and v._p_1 < 1.0]
    if not found:
        return None
    keys = next((v.stream for _, _, v in found if isinstance(v, KeyedDropout)), None) or DropoutKeys()
    for parent, k, v in found:
        if not isinstance(v, KeyedDropout) or v.stream is not keys:
            parent[k] = KeyedDropout(1.0 - v._p_1, keys)
            parent[k].train(v.training)
    return keys


def adapter_config(cfg: LoraConfig, model: nn.Module, base_model: dict | None = None,
                   chat_template: str | None = None) -> dict:
    """``adapter_config.json``: mlx-lm's keys, plus ``base_model`` (where the base weights are) and
    ``chat_template`` (the Jinja text the training prompts were rendered with when it is not the base's own,
    :func:`dtrain.data.templates.trained_template`; ``dtrain export`` writes it into the exports).

    ``base_model`` is what :class:`dtrain.models.LoadedModel` records: the path
    and sha256 of a GGUF file, the path and content fingerprint of a model folder,
    or a hub id. mlx-lm ignores the extra key; a reader uses it to find the model
    the adapter belongs to.
    """
    n_layers = len(model.layers)
    num_layers = n_layers if cfg.num_layers < 0 else min(cfg.num_layers, n_layers)
    out = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": lora_parameters(cfg)}
    if base_model:
        out["base_model"] = base_model
    if chat_template is not None:
        out["chat_template"] = chat_template
    return out


def save_weights(path: Path, weights: dict) -> None:
    """``mx.save_safetensors`` given the tensors in name order, so the same names and values give the same
    bytes whatever order ``weights`` was built in (a reloaded best step's differs from the model's)."""
    mx.save_safetensors(str(path), dict(sorted(weights.items())))


def write_adapter(folder: Path, model: nn.Module, cfg: LoraConfig, base_model: dict | None = None,
                  chat_template: str | None = None, weights: dict | None = None) -> None:
    """Write ``adapters.safetensors`` and ``adapter_config.json`` into an existing ``folder``.

    ``weights``: flat name -> array to write instead of the model's trainable
    parameters (a kept best step). Not atomic by itself: callers write into a
    folder made by :func:`dtrain.files.atomic_folder` (this function and checkpoints).
    """
    weights = dict(tree_flatten(model.trainable_parameters())) if weights is None else weights
    save_weights(folder / ADAPTER_WEIGHTS, weights)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, model, base_model, chat_template), indent=2))


def save_adapter(model: nn.Module, cfg: LoraConfig, out_dir: str | Path, base_model: dict | None = None,
                 chat_template: str | None = None, weights: dict | None = None) -> Path:
    """Write the adapter folder atomically (:func:`dtrain.files.atomic_folder`).

    Args:
        model: model with LoRA layers.
        cfg: the LoRA config it was built with.
        out_dir: destination folder; replaced as a whole if it exists.
        base_model: the base model reference for ``adapter_config.json``.
        chat_template: the training template for ``adapter_config.json`` (see :func:`adapter_config`).
        weights: flat weights to write instead of the model's (:func:`write_adapter`).
    Returns:
        ``out_dir`` as a Path.
    Raises:
        OSError: from the filesystem; an existing ``out_dir`` is then untouched.
    """
    out = Path(out_dir)
    with atomic_folder(out) as tmp:
        write_adapter(tmp, model, cfg, base_model, chat_template, weights)
    return out


def lora_from_adapter(cfg: LoraConfig, folder: str | Path) -> LoraConfig:
    """``cfg`` with the rank, scale, keys and num_layers of the mlx-lm adapter in ``folder``
    (its ``adapter_config.json``; the scale as written, so ``rslora`` is off); dropout and
    ``plus_ratio`` stay ``cfg``'s.

    Raises:
        ConfigError: no such folder, no or unreadable ``adapter_config.json``, no weights
            file, or an adapter that is not LoRA.
    """
    folder = home_path(folder, "train.init_adapter")
    where = f"train.init_adapter {folder}"
    if not folder.is_dir():
        what = "a file, not an adapter folder" if folder.exists() else "no such folder"
        raise ConfigError(f"{where}: {what} (an mlx-lm adapter folder is expected)")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"{where}: no {ADAPTER_WEIGHTS} (expected an mlx-lm adapter folder){run_folder_hint(folder)}")
    try:
        meta = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        params = meta["lora_parameters"]
        shape = {"rank": params["rank"], "scale": params["scale"], "keys": params.get("keys"),
                 "num_layers": meta.get("num_layers", cfg.num_layers)}
    except FileNotFoundError:
        raise ConfigError(f"{where}: no {ADAPTER_CONFIG}") from None
    except OSError as err:  # a folder of that name, no permission, an I/O error
        raise ConfigError(f"{where}: cannot read {ADAPTER_CONFIG} ({err.strerror or err})") from None
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        why = TOO_DEEP if isinstance(err, RecursionError) else repr(err)
        raise ConfigError(f"{where}: {ADAPTER_CONFIG} has no readable lora_parameters rank and scale ({why})") from None
    if meta.get("fine_tune_type", "lora") != "lora":
        raise ConfigError(f"{where}: fine_tune_type {meta['fine_tune_type']!r}; only lora adapters can be trained on")
    shape = {k: checked_adapter_value(k, v, f"{where}: {ADAPTER_CONFIG}") for k, v in shape.items()}
    return dataclasses.replace(cfg, rslora=False, **shape)


def run_folder_hint(folder: Path) -> str:
    """What to say of a folder given as an adapter that is a run's output folder (its adapter in ``adapters/``):
    ``"; FOLDER is a run's output folder: its adapter is FOLDER/adapters"``, else ``""``."""
    inner = OutputDir(folder).adapters
    return f"; {folder} is a run's output folder: its adapter is {inner}" if (inner / ADAPTER_WEIGHTS).is_file() else ""


def checked_adapter_value(key: str, value, where: str):
    """An ``adapter_config.json`` value (``num_layers``, ``lora_parameters`` ``rank``, ``scale``, ``dropout``, ``keys``)
    within the bounds of the lora key it stands for, as training and ``dtrain export`` read it: a scale of 0 would train
    or merge nothing, a rank of 0 build no LoRA, mlx-lm slices ``model.layers[-num_layers:]``, a part of them for -5,
    and its dropout layer refuses a probability outside [0, 1).

    Raises:
        ConfigError: starting with ``where`` and the key.
    """
    return checked(LoraConfig, key, value, f"{where} {'' if key == 'num_layers' else 'lora_parameters.'}{key}")


def adapter_keys_source(folder: str | Path) -> str:
    """How a message names the keys an initial adapter (:func:`lora_from_adapter`) sets: the user never
    wrote ``lora.keys``, its ``adapter_config.json`` did."""
    return f"train.init_adapter {home_path(folder, 'train.init_adapter')}: {ADAPTER_CONFIG} lora_parameters.keys"


def replaced_by_adapter(cfg: LoraConfig, adapted: LoraConfig) -> list:
    """The keys ``cfg`` sets away from their defaults that :func:`lora_from_adapter` replaced in
    ``adapted``, as ``"lora.rank 4 -> 8"``: the adapter's shape wins, and a value the user set
    should not vanish unsaid."""
    default = LoraConfig()
    return [f"lora.{k} {getattr(cfg, k)!r} -> {getattr(adapted, k)!r}" for k in ("rank", "scale", "keys", "num_layers",
                                                                                  "rslora")
            if getattr(cfg, k) != getattr(default, k) and getattr(cfg, k) != getattr(adapted, k)]


def non_finite_tensors(tensors: dict, names) -> list[str]:
    """The ``names`` (sorted) whose tensor in ``tensors`` holds NaN or inf: an adapter to start from or to merge
    must have none."""
    return sorted(k for k in names if not mx.isfinite(tensors[k]).all().item())


def load_adapter_weights(model: nn.Module, folder: str | Path) -> None:
    """Set ``model``'s LoRA weights (built by :func:`apply_lora`) to those of ``folder/adapters.safetensors``.

    Raises:
        ConfigError: the file's names or shapes differ from the model's LoRA parameters, or a tensor holds
            NaN or inf (named): every step would be skipped as non-finite and the adapter written keep it.
        StorageError: the file cannot be read (damaged, truncated, unreadable).
    """
    path = home_path(folder, "train.init_adapter") / ADAPTER_WEIGHTS
    with storage(f"read train.init_adapter {path}"):  # a damaged file is MLX's RuntimeError
        weights = mx.load(str(path))
    mine = dict(tree_flatten(model.trainable_parameters()))
    missing, extra = sorted(set(mine) - set(weights)), sorted(set(weights) - set(mine))
    if missing or extra:
        raise ConfigError(f"train.init_adapter {path}: its tensors do not match the model's LoRA parameters "
                          f"(missing: {', '.join(missing[:3]) or 'none'}; unexpected: {', '.join(extra[:3]) or 'none'})")
    odd = next((k for k in mine if tuple(mine[k].shape) != tuple(weights[k].shape)), None)
    if odd is not None:
        raise ConfigError(f"train.init_adapter {path}: {odd} has shape {tuple(weights[odd].shape)}, the model's LoRA "
                          f"has {tuple(mine[odd].shape)}")
    if broken := non_finite_tensors(weights, mine):
        bad = int((~mx.isfinite(weights[broken[0]])).sum())
        raise ConfigError(f"train.init_adapter {path}: {broken[0]} holds {bad} non-finite value(s) (NaN or inf); an "
                          f"adapter to start from must be finite")
    model.load_weights([(k, weights[k].astype(mine[k].dtype)) for k in mine], strict=False)
