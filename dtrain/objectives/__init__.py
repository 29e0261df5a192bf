"""Training objectives beside ORPO (``dtrain.objective``), one per file, chosen by
``objective.kind`` through :data:`OBJECTIVES` (docs/objectives.md)."""

from __future__ import annotations

from ..objective import ORPO
from .dpo import DPO
from .sft import SFT
from .simpo import SimPO

OBJECTIVES = {"orpo": ORPO, "dpo": DPO, "simpo": SimPO, "sft": SFT}


def objective_for(cfg):
    """The objective of a run's ``Config`` (``objective.kind``; ORPO reads the ``orpo`` section)."""
    return OBJECTIVES[cfg.objective.kind].from_config(cfg)


__all__ = ["DPO", "OBJECTIVES", "ORPO", "SFT", "SimPO", "objective_for"]
