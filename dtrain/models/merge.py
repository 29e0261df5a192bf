"""An mlx-lm adapter fused into its base, after checking it fits and is the base it was trained on.

The adapter is applied and fused with mlx-lm's own machinery, as ``mlx_lm.fuse``
does (``tuner.utils.load_adapters``, then ``LoRALinear.fuse`` on every LoRA
layer: ``W + scale * (B^T A^T)``). ``training_template`` reads which chat template
the adapter was trained with, for the exports to carry (export.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import ConfigError, DataError, ModelError
from ..files import storage
from ..lora import checked_adapter_value, non_finite_tensors, run_folder_hint
from .load import LoadedModel, load_model, read_json_object

ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")


# base_model's keys: (key, label, what the base is)
BASE_IDENTITIES = (("sha256", "sha256", "file"), ("fingerprint", "content fingerprint", "folder"))


def check_base(adapter_dir: str, base: str, loaded: LoadedModel,
               report: Callable[[str], None] | None = None) -> None:
    """Refuse a base other than the one the adapter was trained on.

    ``adapter_config.json``'s ``base_model`` (written by dtrain's trainer from
    ``LoadedModel.reference``) holds the training base's sha256 when it was a GGUF
    file, its content fingerprint (``folder_fingerprint``) when it was a model
    folder; a base whose value differs is another model, even with the same shapes.
    Nothing is compared when either side lacks the key (a hub id, a GGUF against a
    folder, an adapter from another tool or from dtrain before folder fingerprints);
    ``report`` is told so when the adapter recorded one (a merged export given as the base
    would get the adapter twice).

    Raises:
        ModelError: the two sha256 or fingerprints differ (names both), or ``base_model`` is not an object
            with text in these keys (the check would be skipped unsaid).
    """
    config = Path(adapter_dir) / "adapter_config.json"
    recorded = json.loads(config.read_text()).get("base_model", {})
    odd = ("base_model", recorded) if not isinstance(recorded, dict) else next(
        ((f"base_model.{key}", recorded[key]) for key, _, _ in BASE_IDENTITIES
         if key in recorded and not isinstance(recorded[key], str)), None)
    if odd is not None:
        raise ModelError(f"{config}: {odd[0]} is {json.dumps(odd[1])[:60]}, not "
                         f"{'an object' if odd[0] == 'base_model' else 'text'} (dtrain records the training base's "
                         "path and its sha256 or content fingerprint there); correct or remove it, or pass "
                         "--allow-base-mismatch to merge without the check")
    for key, label, kind in BASE_IDENTITIES:
        want, got = recorded.get(key), loaded.reference.get(key)
        if want is not None and got is not None and want != got:
            raise ModelError(f"{config}: the adapter was trained on {recorded.get('path', '?')} ({label} "
                             f"{want[:16]}...), but --base {base} is another {kind} ({label} {got[:16]}...); export "
                             "onto the base it was trained on, or pass --allow-base-mismatch to merge it anyway")
    recorded_by = [(key, label) for key, label, _ in BASE_IDENTITIES if key in recorded]
    if report is not None and recorded_by and all(loaded.reference.get(key) is None for key, _ in recorded_by):
        report(f"{config}: the adapter was trained on {recorded.get('path', '?')} (recorded by its "
               f"{recorded_by[0][1]}); --base {base} cannot be compared with it: make sure it is that model (not an "
               "export that already holds the adapter)")


def check_adapter_config(path: Path) -> dict:
    """Refuse an ``adapter_config.json`` that mlx-lm's ``load_adapters`` would misread as an adapter that does not
    fit the base: not a JSON object, ``num_layers`` / ``lora_parameters`` ``rank``, ``scale`` and ``dropout`` of another
    type or out of the bounds training takes them in, ``lora_parameters.keys`` that is not a list of module names, or
    ``lora_parameters`` without ``rank``, ``scale`` or ``dropout``.

    Returns:
        The parsed config.
    Raises:
        ModelError: naming the file and the key.
    """
    meta = read_json_object(path)
    params = meta.get("lora_parameters", {})
    values = [("num_layers", meta.get("num_layers", 0), int, "an integer"),
              ("lora_parameters", params, dict, "an object")]
    if isinstance(params, dict):
        values += [("lora_parameters.rank", params.get("rank", 0), int, "an integer"),
                   ("lora_parameters.scale", params.get("scale", 0.0), (int, float), "a number"),
                   ("lora_parameters.dropout", params.get("dropout", 0.0), (int, float), "a number")]
    for key, value, kind, what in values:
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ModelError(f"{path}: {key} is {json.dumps(value)}, not {what}")
    keys = params.get("keys")  # mlx-lm asks `name in keys`: a string would match its substrings
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ModelError(f"{path}: lora_parameters.keys is {json.dumps(keys)}, not a list of module names")
    missing = [k for k in ("rank", "scale", "dropout") if "lora_parameters" in meta and k not in params]
    if missing:
        hint = " (PEFT's alpha / rank is mlx-lm's scale)" if "scale" in missing and "alpha" in params else ""
        raise ModelError(f"{path}: lora_parameters has no {', '.join(missing)}, which mlx-lm's LoRA layers "
                         f"take{hint}")
    try:  # the bounds train.init_adapter reads them with
        for key, value in (("num_layers", meta.get("num_layers")), ("rank", params.get("rank")),
                           ("scale", params.get("scale")), ("dropout", params.get("dropout"))):
            if value is not None:
                checked_adapter_value(key, value, f"{path}:")
    except ConfigError as err:
        raise ModelError(str(err)) from None
    return meta


def check_adapter_rank(folder: Path, saved: dict, rank: int) -> None:
    """Refuse LoRA tensors of another rank than ``adapter_config.json``'s ``lora_parameters.rank`` (an edited config,
    or another adapter's), which mlx-lm's shape error would blame on the base. Each module's ``lora_a`` ``(in, r)``
    and ``lora_b`` ``(r, out)``, or ``(experts, r, in)`` and ``(experts, out, r)`` (mlx-lm's ``LoRALinear``,
    ``LoRAEmbedding``, ``DoRALinear``, ``LoRASwitchLinear``), must all name one rank for the config to be the odd one
    out; other shapes are left to mlx-lm's shape check.

    Raises:
        ModelError: naming both files, the tensors' rank and the first ``lora_a``.
    """
    def pair_rank(a, b):  # None where the pair's shapes name no one rank (or lora_b is missing)
        if b is None or a.ndim not in (2, 3) or b.ndim != a.ndim:
            return None
        return a.shape[1] if b.shape[0 if b.ndim == 2 else 2] == a.shape[1] else None

    pairs = {k: pair_rank(v, saved.get(k[: -len("lora_a")] + "lora_b")) for k, v in sorted(saved.items())
             if k.endswith(".lora_a")}
    ranks = set(pairs.values())
    if len(ranks) == 1 and None not in ranks and rank not in ranks:
        (found,), first = ranks, next(iter(pairs))
        raise ModelError(f"{folder / 'adapter_config.json'}: lora_parameters.rank is {rank}, but "
                         f"{folder / 'adapters.safetensors'} holds LoRA tensors of rank {found} "
                         f"({first}: {tuple(saved[first].shape)}); the config is not the one the adapter was trained "
                         "with")


def merge_adapter(adapter_dir: str, base: str, allow_base_mismatch: bool = False,
                  report: Callable[[str], None] | None = None) -> tuple[LoadedModel, dict]:
    """Load ``base`` in float32 and fuse the mlx-lm adapter in ``adapter_dir`` into it
    (a base other than the recorded one only with ``allow_base_mismatch``: :func:`check_base`).

    Returns:
        ``(loaded, updates)``: the loaded base whose LoRA layers are replaced by
        fused ``nn.Linear``, and per fused weight name ``‖ΔW‖`` (Frobenius), ΔW the
        fused weight less the base's (``scale * lora_b.T @ lora_a.T`` as in mlx-lm's
        ``LoRALinear.fuse``; a DoRA adapter's magnitude rescaling included).

    Raises:
        ModelError: missing adapter files, a config whose rank is not its tensors' (:func:`check_adapter_rank`),
            an adapter whose layers or shapes do not fit the base (names the adapter and the base), LoRA tensors
            missing or holding NaN or inf (named), or another base.
    """
    from mlx_lm.tuner.utils import load_adapters

    folder = Path(adapter_dir)
    if not folder.is_dir():  # a mistyped path: say so, not which files it lacks
        raise ModelError(f"{adapter_dir}: no such adapter folder" + (" (a file)" if folder.exists() else ""))
    missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        raise ModelError(f"{adapter_dir}: not an adapter folder (missing {', '.join(missing)}){run_folder_hint(folder)}")
    meta = check_adapter_config(folder / "adapter_config.json")
    with storage(f"read the adapter {adapter_dir}"):
        saved = mx.load(str(folder / "adapters.safetensors"))
    if "lora_parameters" in meta:
        check_adapter_rank(folder, saved, meta["lora_parameters"]["rank"])
    loaded = load_model(base, dtype="float32")
    try:
        with storage(f"read the adapter {adapter_dir}"):
            load_adapters(loaded.model, str(folder))
    except AttributeError as err:  # load_adapters reads num_layers and lora_parameters as attributes
        raise ModelError(f"{folder / 'adapter_config.json'}: no '{err.name}' (an mlx-lm LoRA adapter config has "
                         "fine_tune_type, num_layers and lora_parameters)") from None
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
        detail = " ".join(str(err).split())[:400]
        raise ModelError(f"{adapter_dir}: this adapter does not fit the base model {base}: {detail}") from None
    if not allow_base_mismatch:
        check_base(adapter_dir, base, loaded, report)
    lora = [(name, module) for name, module in loaded.model.named_modules() if hasattr(module, "fuse")]
    # load_adapters loads non-strictly: a LoRA tensor the file lacks would keep its random
    # initialisation (lora_a) or zero (lora_b) and be fused as if it were trained
    expected = {k for k, _ in tree_flatten(loaded.model.parameters())
                if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b", "m")}  # mlx-lm's adapter leaves (DoRA: m)
    missing = sorted(expected - set(saved))
    if missing:
        raise ModelError(f"{folder / 'adapters.safetensors'} lacks {len(missing)} of the {len(expected)} LoRA tensors "
                         f"its adapter_config.json sets up on {base} ({', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}); the adapter is incomplete or its config is not "
                         "the one it was trained with")
    # fused, one NaN spreads through every weight row it touches: the export would be written and run NaN
    if broken := non_finite_tensors(saved, expected):
        raise ModelError(f"{folder / 'adapters.safetensors'} holds NaN or infinite values in {len(broken)} LoRA "
                         f"tensor{'s' * (len(broken) > 1)} ({', '.join(broken[:3])}{' ...' if len(broken) > 3 else ''}),"
                         " which merged weights would carry; the adapter is damaged or from a run that diverged")
    fused = [(name, module.fuse()) for name, module in lora]
    # what the merge changes: scale * B^T A^T for LoRA, DoRA's magnitude rescaling included
    base_weight = lambda m: (m.linear if hasattr(m, "linear") else m.embedding).weight  # noqa: E731
    updates = {f"{name}.weight": float(mx.linalg.norm((new.weight - base_weight(module)).astype(mx.float32)))
               for (name, module), (_, new) in zip(lora, fused)}
    loaded.model.update_modules(tree_unflatten(fused))
    mx.eval(loaded.model.parameters())
    return loaded, updates


# the largest magnitude each written type holds (Q8_0 / Q4_0: 127 or 8 steps of their F16 block scale); past it, inf
LARGEST = {"F16": "65504", "float16": "65504", "Q8_0": "8.31901e+06: 127 steps of its F16 block scale",
           "Q4_0": "524032: 8 steps of its F16 block scale"}


def overflow_text(name: str, merged, type_name: str) -> str:
    """What to say of the merged weight ``name`` (float32 numpy) that ``type_name`` (a GGUF type or a dtype) writes
    as inf: a finite but huge LoRA value (a damaged file's flipped exponent bit) passes the adapter's own checks."""
    largest = LARGEST.get(type_name, f"{float(np.finfo(np.float32).max):g}")
    return (f"{name} merged with the adapter holds values up to {float(np.abs(merged).max()):.3g}, beyond what "
            f"{type_name} can hold ({largest}): it would be written as inf; the adapter is damaged or from a run "
            "that diverged")


def training_template(adapter_dir: str, tokenizer=None) -> str | None:
    """The chat template an adapter was trained with when it replaced the base's (None: the base's own).

    ``adapter_config.json``'s ``chat_template`` (written by dtrain's trainer), else
    ``data.chat_template`` of the ``config.yaml`` in the same folder (checkpoints).
    With ``tokenizer``, the template is compiled as training compiled it (a hand-edited one may not).

    Raises:
        ModelError: a recorded ``chat_template`` that is not text or not valid Jinja, or a recorded
            ``data.chat_template`` that is no longer readable.
    """
    from ..data.formats import json_kind
    from ..data.templates import make_renderer, template_source

    folder = Path(adapter_dir)
    where = f"{folder / 'adapter_config.json'}: chat_template"
    text = json.loads((folder / "adapter_config.json").read_text()).get("chat_template")
    if text is not None and not isinstance(text, str):
        raise ModelError(f"{where}: a JSON {json_kind(text)}, not a Jinja template's text")
    config = folder / "config.yaml"
    name = _run_chat_template(config) if text is None and config.is_file() else None
    if name is not None:
        try:
            text = template_source(name)
        except DataError as err:
            raise ModelError(f"{config}: the run's {err}") from None
        where = f"{config}: the run's data.chat_template {name}"
    if text is not None and tokenizer is not None:
        try:
            make_renderer(tokenizer, text, where)
        except DataError as err:  # a Jinja syntax error, with its line
            raise ModelError(str(err)) from None
    return text


def _run_chat_template(config: Path) -> str | None:
    """``data.chat_template`` of a checkpoint's ``config.yaml`` (None: unset); read by hand, not as a config,
    so that a key an older dtrain wrote does not stop the export.

    Raises:
        ModelError: the file is not YAML, not a config's sections, or the key is not text.
    """
    import yaml

    try:
        raw = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise ModelError(f"{config}:{f' line {mark.line + 1}' if mark else ''} invalid YAML: "
                         f"{getattr(err, 'problem', err)}") from None
    except ValueError as err:  # not UTF-8, a scalar Python cannot build
        raise ModelError(f"{config}: invalid YAML: {err}") from None
    data = (raw.get("data") or {}) if isinstance(raw, dict) else None
    if not isinstance(data, dict):
        what = "not a mapping of config sections" if data is None else f"section 'data' is {data!r}, not a mapping"
        raise ModelError(f"{config}: data.chat_template unreadable: {what}")
    name = data.get("chat_template")
    if name is not None and not isinstance(name, str):
        raise ModelError(f"{config}: data.chat_template is {name!r}, not a template name or Jinja file")
    return name
