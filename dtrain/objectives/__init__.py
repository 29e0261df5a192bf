"""Training objectives beside ORPO (``dtrain.objective``), one per file, chosen by
``objective.kind`` through :data:`OBJECTIVES` (docs/objectives.md)."""

from __future__ import annotations

import copy
import dataclasses

from ..errors import DataError

from ..objective import ORPO
from .dpo import DPO
from .sft import SFT
from .simpo import SimPO

OBJECTIVES = {"orpo": ORPO, "dpo": DPO, "simpo": SimPO, "sft": SFT}


def objective_for(cfg):
    """The objective of a run's ``Config`` (``objective.kind``; ORPO reads the ``orpo`` section)."""
    return OBJECTIVES[cfg.objective.kind].from_config(cfg)


def fit_dataset(objective, dataset):
    """``dataset`` (train and valid pairs) as ``objective`` trains it: SFT keeps the chosen side
    of preference pairs (the rejected side is never run); a pairwise objective refuses rows
    with one completion.

    Raises:
        DataError: an SFT row (``messages``, ``prompt_completion``, ``text``) under a pairwise
            objective, naming its ``file:line``.
    """
    out = copy.copy(dataset)  # the caller's dataset stays as it was
    if isinstance(objective, SFT):
        out.train, out.valid = ([dataclasses.replace(p, rejected=[], rejected_prompt=None) for p in pairs]
                                for pairs in (dataset.train, dataset.valid))
        return out
    single = next((p for p in (*dataset.train, *dataset.valid) if not p.rejected), None)
    if single is not None:
        raise DataError(f"{single.source or '?'}: a row with one completion (no rejected response) cannot train "
                        f"objective.kind {type(objective).__name__.lower()}; set objective.kind: sft, or give "
                        f"preference rows (chosen and rejected)")
    return out


__all__ = ["DPO", "OBJECTIVES", "ORPO", "SFT", "SimPO", "fit_dataset", "objective_for"]
