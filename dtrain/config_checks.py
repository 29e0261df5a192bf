"""What a config value and a whole config must satisfy: each key's type and allowed
values (``checked``), and the rules between keys (``check_rules``), with the messages that
name the key, the file and the fix. ``dtrain.config`` defines the keys and reads them.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import typing
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from .errors import ConfigError
from .run.best import REPORTED

if TYPE_CHECKING:
    from .config import Config

FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max

# YAML spells some keys differently from Python identifiers.
ALIASES = {"lambda": "lam"}


def yaml_key(name: str) -> str:
    """The YAML spelling of a field name (``lam`` -> ``lambda``)."""
    return {v: k for k, v in ALIASES.items()}.get(name, name)


def type_name(tp: Any) -> str:
    """``int``, ``int or 'auto'``, ``str or null``: a field's type as the user writes it."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    return getattr(origin or tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints widen to floats.

    Raises:
        ConfigError: the value fits none of the annotation's types.
    """
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if isinstance(value, datetime.date):  # no key takes a date; for a text key, text that looks like one is meant
        quote = f"; quote it: '{value}'" if str in (tp, *typing.get_args(tp)) else ""
        raise ConfigError(f"{where}: expected {type_name(tp)}, got the date {value} (YAML reads an unquoted date as "
                          f"one){quote}")
    inner = _date_inside(value)
    if inner is not None:  # lora.keys and data.fields hold names
        raise ConfigError(f"{where}: expected text inside, got the date {inner} (YAML reads an unquoted date as one); "
                          f"quote it: '{inner}'")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{where}: expected {type_name(tp)}, got {value!r}")
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: expected {type_name(tp).replace(' or null', '')}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{where}: expected {type_name(tp)}, got {value!r}")
    if not isinstance(value, origin or tp):
        raise ConfigError(f"{where}: expected {type_name(tp)}, got {value!r}")
    return value


def _date_inside(value: Any) -> Optional[datetime.date]:
    """The first date inside a list or mapping (its keys too), at any depth, or None."""
    inner = [*value.keys(), *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else []
    for item in inner:
        found = item if isinstance(item, datetime.date) else _date_inside(item)
        if found is not None:
            return found
    return None


def _check_allowed(value: Any, meta: dict, where: str) -> None:
    """The field's own allowed values (``option(choices=, at_least=, below=)``)."""
    choices = meta.get("choices")
    if choices and value is not None and value not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}; got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not math.isfinite(value):  # NaN fails every comparison below, so it would pass every bound
        raise ConfigError(f"{where} must be a finite number; got {value}")
    if isinstance(value, float) and meta.get("float32", True) and abs(value) > FLOAT32_MAX:  # inf where MLX reads it
        raise ConfigError(f"{where} must be a finite float32 number (MLX computes in float32, whose largest is "
                          f"{FLOAT32_MAX:.2g}); got {value}")
    if isinstance(value, int) and not -2**63 <= value < 2**63:  # numpy, MLX and TensorBoard hold int64
        raise ConfigError(f"{where} must fit in 64 bits (below 2**63); got {value}")
    if meta.get("dimension") and value >= 2**31:  # mlx-lm's LoRA matrices, a row padded to the bucket
        raise ConfigError(f"{where} must be below 2**31 (an array dimension: MLX's shapes are int32); got {value}")
    lo, above, hi, top = meta.get("at_least"), meta.get("above"), meta.get("below"), meta.get("at_most")
    if lo is not None and hi is not None and not lo <= value < hi:
        raise ConfigError(f"{where} must be in [{lo:g}, {hi:g}); got {value}")
    if lo is not None and top is not None and not lo <= value <= top:
        raise ConfigError(f"{where} must be in [{lo:g}, {top:g}]; got {value}")
    if lo is not None and value < lo:
        raise ConfigError(f"{where} must be >= {lo:g}; got {value}")
    if above is not None and value <= above:
        raise ConfigError(f"{where} must be > {above:g}; got {value}")
    if hi is not None and value >= hi:
        raise ConfigError(f"{where} must be < {hi:g}; got {value}")


def did_you_mean(word: str, known, prefix: str = "") -> str:
    """``did you mean 'x'? `` for the known name closest to a misspelt one (difflib's ratio of at least
    0.75: one or two letters off), else ``""``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.75)
    return f"did you mean '{prefix}{close[0]}'? " if close else ""


def checked(cls, name: str, value: Any, where: str) -> Any:
    """``value`` as the field ``name`` of the section class ``cls`` takes it: its type and allowed values.

    Raises:
        ConfigError: starting with ``where``.
    """
    tp, meta = typing.get_type_hints(cls)[name], {f.name: f for f in dataclasses.fields(cls)}[name].metadata
    if isinstance(value, bool) and str in (tp, *typing.get_args(tp)):  # YAML's false for null, or yes for a name
        raise ConfigError(f"{where}: expected {type_name(tp)}, got {str(value).lower()} ({meta['help']})")
    value = _coerce(value, tp, where)
    _check_allowed(value, meta, where)
    return value


# Which objective.kind reads each objective key (and the orpo section); a key set for another kind is an error.
OBJECTIVE_KEYS = {("objective", "beta"): ("dpo", "simpo"), ("objective", "loss_type"): ("dpo",),
                   ("objective", "simpo_gamma"): ("simpo",), ("objective", "nll_weight"): ("simpo",),
                   ("objective", "completion_only_loss"): ("sft",), ("orpo", "lam"): ("orpo",),
                   ("orpo", "nll_scope"): ("orpo",),
                   **{("orpo", f"lambda_{k}"): ("orpo",) for k in ("schedule", "min", "max", "step", "backoff",
                                                                   "window", "epsilon", "stop_drop", "law", "kd")}}


# Keys another key's value leaves unread: (section, name) -> [(the setting that does, is it this config's)].
_REFERENCE = ("engine.kind reference", lambda c: c.engine.kind == "reference")
_STATIC = ("orpo.lambda_schedule static", lambda c: c.orpo.lambda_schedule == "static")
_DEMO = ("data.demo_pairs (generated standard rows)", lambda c: c.data.demo_pairs > 0)  # data.load_dataset
UNREAD_WHEN = {
    **{("data", k): [_DEMO] for k in ("format", "fields", "split")},
    ("data", "demo_seed"): [("data.demo_pairs 0", lambda c: c.data.demo_pairs == 0)],
    **{("engine", k): [_REFERENCE] for k in ("prefix_sharing", "head_chunk_tokens", "length_bucket", "pack",
                                              "attention_groups", "compile", "kernels")},
    ("engine", "segment_layers"): [_REFERENCE, ("engine.kind auto (it sizes the ranges itself)",
                                                lambda c: c.engine.kind == "auto")],
    **{("orpo", f"lambda_{k}"): [_STATIC] for k in ("min", "max", "step", "window", "epsilon", "stop_drop", "law")},
    ("orpo", "lambda_backoff"): [_STATIC, ("orpo.lambda_law pd", lambda c: c.orpo.lambda_law == "pd")],
    ("orpo", "lambda_kd"): [_STATIC, ("orpo.lambda_law aimd", lambda c: c.orpo.lambda_law == "aimd")],
    ("orpo", "lam"): [("orpo.lambda_schedule adaptive (lambda starts at orpo.lambda_min)",
                       lambda c: c.orpo.lambda_schedule == "adaptive")],
    ("train", "min_lr_ratio"): [("train.schedule constant", lambda c: c.train.schedule == "constant")],
}


def unread_keys(cfg: Config) -> list:
    """One line per key set away from its default that another key's value leaves unread
    (``engine.head_chunk_tokens`` under ``engine.kind reference``, the controller's ``orpo.lambda_*``
    under a static schedule, ...): a notice, not an error, so one override (``--engine.kind
    reference``) can try another setting. Keys of another objective are errors (:func:`check_rules`)."""
    defaults, lines = type(cfg)(), []
    for (section, name), why in unread(cfg).items():
        if section == "orpo" and cfg.objective.kind != "orpo":
            continue  # check_rules refuses these
        value = getattr(getattr(cfg, section), name)
        if value != getattr(getattr(defaults, section), name):
            lines.append(f"'{section}.{yaml_key(name)}' is {value!r} but {why} does not read it: it has no effect")
    return lines


def unread(cfg) -> dict:
    """``{(section, name): the setting that leaves it unread}`` for the keys of :data:`UNREAD_WHEN` that
    ``cfg``'s values leave unread, whatever their own value (``cfg``: a Config, or anything with its
    attributes)."""
    found = {}
    for key, settings in UNREAD_WHEN.items():
        why = next((setting for setting, applies in settings if applies(cfg)), None)
        if why is not None:
            found[key] = why
    return found


def check_rules(cfg: Config, source: str, need_data: bool = True) -> None:
    """Rules across keys, checked once after every override is applied; every broken rule is
    named in one ConfigError (a config written for one objective may break several). ``need_data``:
    a run's config must name its pairs (``dtrain config`` prints one that need not)."""
    kind, defaults, problems = cfg.objective.kind, type(cfg)(), []
    for (section, name), kinds in OBJECTIVE_KEYS.items():
        value = getattr(getattr(cfg, section), name)
        if kind not in kinds and value != getattr(getattr(defaults, section), name):
            problems.append(f"'{section}.{yaml_key(name)}' is {value!r} but objective.kind {kind} does "
                            f"not read it (it applies to {', '.join(kinds)}); remove it or change objective.kind")
    if cfg.data.train is not None and cfg.data.demo_pairs > 0:
        problems.append(f"both 'data.train' ({cfg.data.train}) and 'data.demo_pairs' ({cfg.data.demo_pairs}) are set; "
                        "use one (configs/demo.yaml generates pairs: add --data.demo_pairs 0 to train on a file)")
    for key in ("valid", "valid_split"):  # unread: load_dataset splits the generated pairs
        if getattr(cfg.data, key) is not None and cfg.data.demo_pairs > 0:
            problems.append(f"'data.{key}' ({getattr(cfg.data, key)}) is set but 'data.demo_pairs' "
                            f"({cfg.data.demo_pairs}) generates the pairs, holding out data.valid_fraction of them; "
                            f"remove data.{key}, or set data.demo_pairs 0 and data.train")
    if cfg.lora.num_layers == 0:  # mlx-lm's linear_to_lora_layers slices model.layers[-0:], i.e. every layer
        problems.append("'lora.num_layers' is 0, which would adapt no layer, yet mlx-lm reads it as all of them; "
                        "set -1 for every layer or N >= 1 for the last N")
    o, t = cfg.orpo, cfg.train
    if kind == "orpo" and o.lambda_schedule == "adaptive" and o.lambda_min > o.lambda_max:
        problems.append(f"'orpo.lambda_min' ({o.lambda_min}) is above 'orpo.lambda_max' ({o.lambda_max})")
    for key, on in (("orpo.lambda_schedule: adaptive", kind == "orpo" and o.lambda_schedule == "adaptive"),
                    (f"train.keep_best: {t.keep_best}", t.keep_best is not None)):
        if on and t.eval_every == 0:
            problems.append(f"'{key}' needs held-out evaluations during the run: set 'train.eval_every' "
                            f"> 0 (it is 0)")
    if t.keep_best is not None and t.keep_best not in REPORTED[kind]:
        problems.append(f"'train.keep_best' is {t.keep_best} but objective.kind {kind} does not report "
                        f"it; choose one of {', '.join(REPORTED[kind])}")
    elif kind == "orpo" and o.lambda_schedule == "adaptive" and t.keep_best in ("eval/loss", "eval/rewards/margins"):
        problems.append(f"'train.keep_best' is {t.keep_best}, which is weighted by lambda, and orpo.lambda_schedule "
                        f"adaptive changes lambda between evaluations, so they do not compare; choose "
                        f"eval/rewards/accuracies, eval/log_odds_ratio or eval/nll_loss")
    # DPO's logps/chosen is a sum per response (TRL) except ipo's (engine.dpo.DPO.per_token_logps)
    if t.keep_best_guard is not None and kind == "dpo" and cfg.objective.loss_type != "ipo":
        problems.append(f"'train.keep_best_guard' ({t.keep_best_guard}) is in nats/token, but objective.kind dpo "
                        f"with loss_type {cfg.objective.loss_type} logs eval/logps/chosen as a sum per response; "
                        f"remove it")
    if t.keep_best_guard is not None and t.keep_best is None:
        problems.append(f"'train.keep_best_guard' ({t.keep_best_guard}) needs 'train.keep_best' (it is off): "
                        f"the guard only filters the steps keep_best chooses from; with keep_best off, unset it too "
                        f"(--train.keep_best_guard null)")
    if t.early_stop_evals and t.keep_best is None:
        problems.append(f"'train.early_stop_evals' ({t.early_stop_evals}) needs 'train.keep_best' "
                        f"(it is off): the stop keeps the best step; with keep_best off, set it to 0 too "
                        f"(--train.early_stop_evals 0)")
    if need_data and cfg.data.train is None and cfg.data.demo_pairs <= 0:
        problems.append("set 'data.train' to a data file, folder or hub dataset id, or 'data.demo_pairs' > 0 for "
                        "generated pairs")
    if len(problems) == 1:
        raise ConfigError(f"{source}: {problems[0]}")
    if problems:
        raise ConfigError(f"{source}: {len(problems)} problems:\n" + "\n".join(f"  - {x}" for x in problems))
