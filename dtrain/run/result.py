"""What a finished run reports: its final metrics, where it wrote, and the one-line summary of its evaluations."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import best as keep_best
from .evaluation import ACCURACY


@dataclass
class TrainResult:
    """What a finished run reports: final metrics, where things were written."""

    steps: int
    history: list = field(default_factory=list)  # per-step metric dicts of this process's steps
    evals: dict = field(default_factory=dict)  # step -> eval metrics, of the whole run (a resume included)
    adapter_dir: Optional[Path] = None
    run_dir: Optional[Path] = None
    skipped_steps: int = 0
    stopped: bool = False  # stopped early by a signal (checkpoint saved)
    stop_signal: Optional[int] = None  # the stop signal this rank received itself (None: another rank's)
    best: Optional[keep_best.Pick] = None  # train.keep_best: the kept step
    best_metric: Optional[str] = None
    early_stopped: bool = False  # train.early_stop_evals ended the run
    nll_of: str = "the completions"  # what eval/nll_loss counts (objective.nll_scope full: the prompts too)

    def summary(self) -> Optional[str]:
        """``eval reward accuracy ...: step 0 A -> step N B`` from the first and last evaluation (sft: the
        held-out NLL), then with ``train.keep_best`` the kept step (and an early stop), or None."""
        if len(self.evals) < 2:
            return None
        first, last = min(self.evals), max(self.evals)
        if ACCURACY not in self.evals[first]:  # sft: no rejected responses, no accuracy
            line = (f"eval NLL of {self.nll_of}: step {first} {keep_best.figure(self.evals[first]['eval/nll_loss'])} "
                    f"-> step {last} {keep_best.figure(self.evals[last]['eval/nll_loss'])}")
        else:
            start = self.evals[first]
            # DPO's model at step 0 is its own reference: every reward 0, no pair preferred (ties count as not);
            # ORPO's and SimPO's rewards (they report an NLL) are 0 at a weight of 0, with no reference
            tied = ("eval/nll_loss" not in start
                    and start.get("eval/rewards/chosen") == start.get("eval/rewards/rejected") == 0.0)
            line = (f"eval reward accuracy (chosen preferred over rejected): step {first} {start[ACCURACY]:.3f}"
                    f"{' (the reference itself: every reward 0)' if tied else ''} -> step {last} "
                    f"{self.evals[last][ACCURACY]:.3f}")
        if self.best is not None:
            line += f"; {keep_best.describe(self.best, self.best_metric, self.steps if self.early_stopped else None)}"
        return line
