"""Engines and objectives: given a micro-batch of tokenized pairs, return the
loss contribution, metric sums and LoRA gradients (``StepResult``).

``reference`` backpropagates through the whole mlx-lm model; ``segmented``
recomputes layer ranges inside ``mx.vjp`` (see segmented.py). Both implement
:class:`Engine` for one model and one objective and return the same outputs;
:func:`make_engine` is the one place that decides which one a run gets.
An objective (objective.py: the seam; loss.py: ORPO) is picked by name from
:data:`OBJECTIVES`.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..config import EngineConfig
from ..notices import notice
from .common import Engine, StepResult, run_micro_batches
from .dpo import DPO
from .attention import group_rows
from .layout import batch_totals, bucket_length
from .loss import ORPO
from .objective import Objective, PairLogps, Totals
from .reference import ReferenceEngine
from .sft import SFT, fit_dataset
from .simpo import SimPO

# Objectives by name (config objective.kind; docs/objectives.md): a new one is a file beside
# loss.py and one line here.
OBJECTIVES = {"orpo": ORPO, "dpo": DPO, "simpo": SimPO, "sft": SFT}


def make_objective(cfg, name: Optional[str] = None) -> Objective:
    """The objective ``name`` (None: the config's ``objective.kind``) of a run's ``Config``
    (``OBJECTIVES[name].from_config(cfg)``)."""
    return OBJECTIVES[name or cfg.objective.kind].from_config(cfg)


def make_engine(cfg: EngineConfig, model, objective, report: Optional[Callable[[str], None]] = notice) -> Engine:
    """The engine named by ``cfg.kind`` for ``model`` and ``objective``, with every fallback decided here.

    ``auto``/``segmented`` get :class:`SegmentedEngine` (``auto``: its plan chosen
    per length bucket from ``cfg.memory_budget_gb``), except where it cannot run,
    which gives the reference engine: an architecture without an adapter in
    ``engine/arch.py``, or trainable parameters outside the decoder layers.
    ``compile`` is dropped with LoRA dropout (compiled ranges would replay one
    mask); ``pack`` is off, without a notice, for sliding-window layers (their
    explicit mask over a packed row is quadratic in its length); ``length_bucket:
    auto`` is 128 on a GPU, 0 on the CPU; ``kernels: auto`` is ``dtrain`` on the CPU,
    ``mlx`` on a GPU (``device.default_kernels``). Each other decision
    that changes what was asked, and the advice for one range with a chunked
    head, is passed to ``report`` once (the trainer reports on rank 0 only).

    Args:
        cfg: the run's ``engine`` section.
        model: an mlx-lm model with LoRA applied.
        objective: the training objective (:func:`make_objective`).
        report: called with each one-line notice (None: silent; default :func:`dtrain.notices.notice`).
    """
    report = report or (lambda _: None)
    if cfg.kind == "reference":
        return ReferenceEngine(model, objective)
    from ..device import default_attention_groups, default_kernels, default_length_bucket
    from .arch import adapter_for, module_name
    from .plan import GIB
    from .segmented import SegmentedEngine, has_dropout, trainable_outside_layers

    arch = adapter_for(model, (default_kernels() if cfg.kernels == "auto" else cfg.kernels) == "dtrain")
    if arch is None:
        report(f"the segmented engine does not support mlx-lm architecture '{module_name(model)}'; "
               f"using the reference engine")
        return ReferenceEngine(model, objective)
    outside = trainable_outside_layers(model, arch.layers)
    if outside:
        report(f"the segmented engine differentiates only decoder-layer parameters; trainable outside them: "
               f"{', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''}; using the reference engine")
        return ReferenceEngine(model, objective)
    size = "auto" if cfg.kind == "auto" else cfg.segment_layers
    if size != "auto" and (size <= 0 or size >= len(arch.layers)) and cfg.head_chunk_tokens > 0:
        report("one range of all layers with a chunked head recomputes every layer; "
               "engine.head_chunk_tokens: 0 gives the single pass (faster, keeps the logits)")
    compile = cfg.compile
    if compile and has_dropout(model):
        report("engine.compile is off: LoRA dropout draws new masks each step, which compiled ranges would replay")
        compile = False
    bucket = default_length_bucket() if cfg.length_bucket == "auto" else cfg.length_bucket
    # silent (the key's help says so): a sliding-window layer's mask over a packed row would span all its sequences
    pack = cfg.pack and all(w is None for w in arch.windows)
    groups = default_attention_groups() if cfg.attention_groups == "auto" else cfg.attention_groups
    return SegmentedEngine(model, arch, objective, size, cfg.prefix_sharing, cfg.head_chunk_tokens, bucket, compile,
                           cfg.memory_budget_gb * GIB, report, pack, groups)


__all__ = ["Engine", "Totals", "PairLogps", "Objective", "ORPO", "DPO", "SimPO", "SFT", "OBJECTIVES", "StepResult",
           "ReferenceEngine", "fit_dataset", "make_engine", "make_objective", "run_micro_batches",
           "batch_totals", "bucket_length", "group_rows"]
