"""The config as text: the ``--section.key VALUE`` arguments of ``dtrain`` and ``./launch``, and
the keys written out with their help and allowed values (``dtrain config``, the comments of
configs/*.yaml, the epilog of ``dtrain train --help``), all from ``config.py``'s field metadata."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .config import Config, describe_fields, load_config
from .config_checks import ALIASES, type_name
from .errors import ConfigError
from .run.best import REPORTED


def is_override_flag(arg: str) -> bool:
    """``--section.key`` or ``--section.key=VALUE``: a dot before any ``=``."""
    return arg.startswith("--") and "." in arg.split("=", 1)[0]


def _reads_as_option(arg: str, options: tuple) -> bool:
    """Whether argparse reads ``arg`` as one of ``options``: the name, ``NAME=VALUE``, a long name shortened
    (``--dry`` for ``--dry-run``: argparse's ``allow_abbrev``) or a short one with its value attached (``-n2``)."""
    name = arg.split("=", 1)[0]
    return any(name == o or (o.startswith("--") and len(name) > 2 and o.startswith(name))
               or (not o.startswith("--") and arg.startswith(o)) for o in options)


def take_overrides(argv: list[str], options: tuple = ()) -> tuple[list[str], list[str]]:
    """Separate ``--section.key VALUE`` and ``--section.key=VALUE`` from other arguments.

    The one parser of the override grammar, for ``dtrain`` and ``./launch``.
    ``(["-n", "2", "--train.steps", "5", "--model.path=x"])`` gives
    ``(["-n", "2"], ["train.steps=5", "model.path=x"])``. ``options``: the command's own
    option names, which an override's value never is (``--train.steps -c a.yaml`` lacks it, and so does
    ``--train.output_dir -n2``: :func:`_reads_as_option`), nor is another override (``--train.output_dir
    --train.steps=3``; a value that looks like one: ``--key=--a.b``).

    Raises:
        ConfigError: an override flag at the end, or before one of ``options`` or another override, with no value.
    """
    others, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if not is_override_flag(arg):
            others.append(arg)
            i += 1
        elif "=" in arg:
            overrides.append(arg[2:])
            i += 1
        elif i + 1 < len(argv) and not _reads_as_option(argv[i + 1], options) and not is_override_flag(argv[i + 1]):
            overrides.append(f"{arg[2:]}={argv[i + 1]}")
            i += 2
        else:
            raise ConfigError(f"override {arg} needs a value")
    return others, overrides


def split_overrides(argv: list[str]) -> list[str]:
    """Overrides from ``argv`` (see :func:`take_overrides`), which must hold nothing else.

    Raises:
        ConfigError: an argument that is not ``--section.key`` (a YAML file is pointed to ``-c``),
            or one that lacks a value.
    """
    others, overrides = take_overrides(argv)
    if others and others[0].lower().endswith((".yaml", ".yml")):  # ./launch takes it bare
        raise ConfigError(f"unexpected argument {others[0]!r}: a config file is given with -c "
                          f"(-c {others[0]})")
    if others:
        raise ConfigError(f"unexpected argument {others[0]!r}: overrides look like --section.key VALUE")
    return overrides


def allowed(tp: Any, meta: dict) -> str:
    """A field's allowed values as comments and ``dtrain config`` show them: ``a | b``, ``>= 0``, ``int or 'auto'``."""
    if meta.get("choices"):
        return " | ".join((*(("null",) if type(None) in typing.get_args(tp) else ()), *meta["choices"]))
    lo, above, hi, top = meta.get("at_least"), meta.get("above"), meta.get("below"), meta.get("at_most")
    bounds = ([f"in [{lo:g}, {hi:g})"] if lo is not None and hi is not None else
              [f"in [{lo:g}, {top:g}]"] if lo is not None and top is not None else
              [x for x in (lo is not None and f">= {lo:g}", above is not None and f"> {above:g}",
                           hi is not None and f"< {hi:g}", top is not None and f"<= {top:g}") if x])
    kind = type_name(tp)
    return ", ".join([kind, *bounds]) if typing.get_origin(tp) is Union else " ".join(bounds) or kind


def yaml_value(value: Any) -> str:
    """``value`` as one line of YAML (``null``, ``true``, ``[a, b]``, ``{prompt: q}``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("...\n").strip()


def describe(cfg: Optional[Config] = None, active: Optional[set] = None) -> str:
    """Every key with its value (the defaults when ``cfg`` is None), allowed values and help,
    as a commented YAML config (what ``dtrain config`` prints). ``active``: the
    ``(section, key)`` pairs a config file sets; the others are commented out
    (how configs/demo.yaml is written: :func:`commented`)."""
    cfg = cfg or Config()
    lines = []
    for section in dataclasses.fields(Config):
        sub = getattr(cfg, section.name)
        lines += [""] if lines and active is not None else []
        lines.append(f"{section.name}:")
        for key, tp, _, meta in describe_fields(type(sub)):
            if (section.name, key) == ("train", "keep_best"):  # the metrics this objective.kind reports
                meta = {**meta, "choices": REPORTED[cfg.objective.kind]}
            off = "" if active is None or (section.name, key) in active else "# "
            text = f"  {off}{key}: {yaml_value(getattr(sub, ALIASES.get(key, key)))}"
            lines.append(f"{text:<34} # {meta.get('help', '')} [{allowed(tp, meta)}]")
    return "\n".join(lines)


def commented(path: str) -> str:
    """The text ``path`` (a config file) should hold: its leading comment block, then every
    key with its help from this module, the keys it sets active and the others commented
    out at their defaults. ``tests/test_config.py`` checks configs/demo.yaml against it."""
    text = Path(path).read_text(encoding="utf-8")
    header = []
    for line in text.splitlines():
        if not line.startswith("#") and line.strip():
            break
        header.append(line)
    raw = yaml.safe_load(text) or {}
    active = {(section, key) for section, keys in raw.items() for key in (keys or {})}
    return "\n".join(header).rstrip() + "\n\n" + describe(load_config(path), active) + "\n"


def override_help() -> str:
    """Every key as a ``--section.key`` override with its default, help and allowed values
    (the epilog of ``dtrain train --help``)."""
    lines, cfg = ["config keys (defaults from dtrain/config.py; override any with --section.key VALUE):"], Config()
    for section in dataclasses.fields(Config):
        for key, tp, default, meta in describe_fields(type(getattr(cfg, section.name))):
            lines.append(f"  --{section.name}.{key} {yaml_value(default)}: {meta.get('help', '')} "
                         f"[{allowed(tp, meta)}]")
    return "\n".join(lines)
