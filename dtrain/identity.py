"""What a resume may change: every config key, classified once.

A resume continues the run its checkpoint belongs to. A change to a key that
decides what is trained (or what its ``eval/`` curve measures) is refused,
naming the key and both values; a key that only says how the run is computed,
logged, kept or where it stops may change. Keys that name a file are compared
by what the file holds, so a moved data file or GGUF continues the run. An
``auto`` is compared by what it chose (``device.resolve_auto``, :data:`AS_RUN`),
so an explicit value equal to that choice continues the run.

:func:`settings` refuses to work while a key of :class:`dtrain.config.Config`
is in none of the three tables, so a key added later cannot be forgotten.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Optional

from .config import Config, to_dict
from .config_checks import unread, yaml_key

# A change alters what is trained or what the run's eval/ metrics compare: refused.
REFUSED = {
    "model.dtype": "the dtype the model computes in",
    "lora.rank": "the adapter's shape", "lora.scale": "the adapter's update scale * B A x",
    "lora.dropout": "the adapter's input dropout", "lora.num_layers": "which layers get adapters",
    "lora.keys": "which modules get adapters", "lora.rslora": "the adapter's update scale",
    "lora.plus_ratio": "the lora_b matrices' learning rate",
    "lora.branch_dtype": "the dtype the adapter's product computes in",
    "objective.kind": "the loss", "objective.beta": "the loss", "objective.loss_type": "the loss",
    "objective.simpo_gamma": "the loss", "objective.nll_weight": "the loss",
    "objective.completion_only_loss": "which tokens the loss counts",
    "data.split": "which rows are read", "data.valid_split": "which held-out rows are read",
    "data.valid_fraction": "the train/held-out split", "data.format": "how rows are read",
    "data.fields": "which columns are read", "data.prompt_template": "how prompts are rendered",
    "data.chat_template": "how conversations are rendered", "data.append_eos": "the response's last token",
    "data.max_length": "where pairs are cut", "data.max_prompt_length": "where prompts are cut",
    "data.demo_pairs": "the generated pairs", "data.demo_seed": "the generated pairs",
    "orpo.lambda": "the loss", "orpo.nll_scope": "the loss",
    **{f"orpo.lambda_{k}": "the loss (the dynamic-λ controller)" for k in (
        "schedule", "min", "max", "step", "backoff", "window", "epsilon", "stop_drop", "law", "kd")},
    "train.global_batch_pairs": "the pairs of each step", "train.seed": "pair order and dropout masks",
    "train.learning_rate": "the schedule", "train.schedule": "the schedule", "train.warmup_steps": "the schedule",
    "train.min_lr_ratio": "the schedule", "train.weight_decay": "the update", "train.grad_clip": "the update",
    "train.eval_pairs": "the held-out pairs eval/ metrics average over",
    # the best step so far (RunState.best_step) was picked by these: changed, it would compare unlike things
    "train.keep_best": "which step adapters/ holds", "train.keep_best_guard": "which steps may be the best",
    "train.early_stop_evals": "where the run stops (its count continues over the resume)",
}

# Accepted keys that decide what is trained where another setting is on: refused then (and compared only
# against checkpoints that recorded them, so runs saved before the rule continue), the refusal saying why.
REFUSED_WHEN = {
    "train.eval_every": ("with an adaptive λ schedule or train.keep_best it decides when λ changes and which steps "
                         "are compared",
                         lambda r: r["train"]["keep_best"] is not None or r["orpo"]["lambda_schedule"] == "adaptive"),
    # every run records the day it rendered with (its checkpoints before the key recorded none: their token ids tell)
    "data.template_date": ("the day a chat template that writes today's date (Llama 3.2's) renders into every pair",
                           lambda r: r["data"]["template_date"] is not None),
    "train.micro_batch_pairs": ("with lora.dropout above 0 it decides the dropout masks, drawn per micro-batch",
                                lambda r: r["lora"]["dropout"] > 0),
    # the masks take the shape of the rows these lay out (engine.kind: the reference engine's rows or the segmented one's)
    **{f"engine.{k}": ("with lora.dropout above 0 it decides the dropout masks, drawn over the micro-batch's rows",
                       lambda r: r["lora"]["dropout"] > 0) for k in ("kind", "prefix_sharing", "pack", "length_bucket")},
}

# Compared by content, not by the text of the key: a moved file continues the run.
BY_CONTENT = {
    "model.path": "the model's identity (a GGUF's sha256; a folder's config.json and weight files: "
                  "sizes, headers, sampled bytes; a hub id's download as that folder)",
    "data.train": "the data files' sha256 and the training pairs' token ids",
    "data.valid": "the data files' sha256 and the held-out pairs' token ids",
    # its weights are the step-0 LoRA and, for dpo, the reference a resume recomputes; its adapter_config.json
    # sets the lora.* keys, compared as those
    "train.init_adapter": "the step-0 adapter's weights file's sha256",
}

# How the run is computed, logged, kept or where it stops: a change is accepted.
ACCEPTED = {
    "train.steps": "where the run stops; the schedule keeps the steps it was planned for (run/optimizer.py, learning_rate)",
    "train.micro_batch_pairs": "accumulation gives the same normalised gradient (not the same dropout masks)",
    "train.compile_optimizer": "the same update, traced", "train.eval_every": "evaluation cadence",
    "train.save_every": "checkpoint cadence", "train.keep_last": "checkpoints kept",
    "train.output_dir": "where the run lives (a moved or copied folder continues)",
    "train.resume": "which checkpoint continues", "train.max_skipped_steps": "when to give up",
    "train.chosen_logps_drop_warn": "a warning threshold", "train.progress": "the progress bar",
    "data.on_bad_row": "skip or stop at a bad row; the pairs trained are checked by their token ids",
    "data.template_date": "null continues with the day the checkpoint recorded",
    **{f"engine.{k}": "how the same gradients are computed" for k in (
        "kind", "segment_layers", "memory_budget_gb", "prefix_sharing", "head_chunk_tokens", "length_bucket",
        "compile", "pack", "attention_groups", "kernels")},
    "distributed.backend": "transport", "distributed.check_sync_every": "a check",
    "distributed.collective_timeout_s": "a watchdog",
}


def config_keys() -> list[str]:
    """Every ``section.key`` of :class:`Config`, read from the dataclasses (YAML spellings)."""
    cfg = Config()
    return [f"{s.name}.{yaml_key(f.name)}" for s in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, s.name))]


def unclassified() -> list[str]:
    """Config keys in none of :data:`REFUSED`, :data:`BY_CONTENT`, :data:`ACCEPTED`."""
    return [k for k in config_keys() if k not in REFUSED and k not in BY_CONTENT and k not in ACCEPTED]


# REFUSED keys (and data entries) added after checkpoints were written: the value such a checkpoint ran with
# (its state.json lacks the key), which a resume compares as if recorded.
BEFORE_KEY = {
    "lora.branch_dtype": "float32",  # mlx-lm's float32 product, before 2026-12-04
    # data.valid_fraction held out rows, not prompts, before 2026-12-07 (recorded only where the two differ)
    "held-out split": "by row (an earlier dtrain)",
}


# `auto` values the device does not decide, as a resume compares them (a checkpoint that recorded the word too)
AS_RUN = {
    "engine.kind": {"auto": "segmented"},  # the segmented engine's rows, its plan chosen per length bucket
}

# An `auto` that follows another key: changed with it, only that key is named (its value sets both back).
FOLLOWS = {"lora.branch_dtype": "model.dtype"}


def as_run(key: str, value):
    """``value`` of ``key`` as a resume compares it: the value :data:`AS_RUN` gives its ``auto``, else itself."""
    return AS_RUN[key].get(value, value) if key in AS_RUN else value


def beta_as_run(was: dict, now: dict) -> tuple:
    """``(was, now)``, a checkpoint's settings and a run's, with ``objective.beta`` null as the beta it trains with
    (dpo's or simpo's default) where both run that ``objective.kind``, so writing that value out continues the run."""
    from .engine import dpo, simpo  # here: importing dtrain.identity loads no MLX

    kind = was.get("objective.kind")
    default = {"dpo": dpo.DEFAULT_BETA, "simpo": simpo.DEFAULT_BETA}.get(kind)
    if default is None or now.get("objective.kind") != kind:  # another kind: that change is the one named
        return was, now
    return tuple({**d, "objective.beta": default} if d.get("objective.beta", 0) is None else d for d in (was, now))


def settings(resolved: dict, defaults: Optional[dict] = None) -> dict:
    """``{"section.key": value}`` of every :data:`REFUSED` key (its default where another key's value leaves it
    unread: :data:`dtrain.config_checks.UNREAD_WHEN`), and of each :data:`REFUSED_WHEN` key whose condition
    holds, from the resolved config (``config.to_dict``; a run's: of ``device.resolve_auto``'s), as
    :func:`as_run` gives them. ``defaults``: ``config.to_dict`` of the defaults, resolved as ``resolved`` is
    (None: ``Config()``'s as written).

    Raises:
        RuntimeError: a config key is not classified (a programming error: add it to a table here).
    """
    missing = unclassified()
    if missing:
        raise RuntimeError(f"config keys not classified for resume in dtrain/identity.py: {', '.join(missing)}")
    # a key another key leaves unread (orpo.lambda_max under a static schedule) decides nothing, as the run's
    # notice says: its default is recorded, so a resume that drops or changes it continues
    view = SimpleNamespace(**{section: SimpleNamespace(**keys) for section, keys in resolved.items()})
    unread_names = {f"{section}.{yaml_key(name)}" for section, name in unread(view)}
    defaults = defaults or to_dict(Config())

    def value(key: str):
        section, name = key.split(".", 1)
        return as_run(key, (defaults if key in unread_names else resolved)[section][name])

    return {**{key: value(key) for key in REFUSED},
            **{key: value(key) for key, (_, when) in REFUSED_WHEN.items() if when(resolved)}}
