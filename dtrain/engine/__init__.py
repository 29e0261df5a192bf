"""Engines: given a micro-batch of tokenized pairs, return the loss
contribution, metric sums and LoRA gradients (``StepResult``).

``reference`` backpropagates through the whole mlx-lm model; ``segmented``
recomputes layer ranges inside ``mx.vjp`` (see segmented.py). Both take the
same config and return the same outputs.
"""

from __future__ import annotations

from ..config import Config
from .common import Norm, StepResult
from .reference import ReferenceEngine


def make_engine(cfg: Config, model):
    """Build the engine named by ``cfg.engine.kind`` for ``model`` (``auto``: the
    segmented engine choosing its plan per length bucket, see ``SegmentedEngine``)."""
    if cfg.engine.kind in ("auto", "segmented"):
        from .segmented import SegmentedEngine

        return SegmentedEngine.from_config(cfg, model)
    return ReferenceEngine(model, cfg.orpo.lam, cfg.orpo.nll_scope)


__all__ = ["Norm", "StepResult", "ReferenceEngine", "make_engine"]
