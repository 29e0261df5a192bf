"""The learning rate as a pure function of the optimizer step."""

from __future__ import annotations

import math
from typing import Optional

from ..config import TrainConfig


def learning_rate(step: int, cfg: TrainConfig, schedule_steps: Optional[int] = None) -> float:
    """Learning rate for optimizer step ``step`` (1-based).

    Linear warmup from ``lr / warmup_steps`` to ``lr`` over ``warmup_steps``,
    then ``constant``, ``linear`` decay or ``cosine`` decay to
    ``min_lr_ratio * lr`` at step ``schedule_steps`` (default ``cfg.steps``).
    Past ``schedule_steps`` the warmup still ends at ``warmup_steps``, and
    then the rate holds at the schedule's last value: a run resumed with a
    larger ``train.steps`` keeps the schedule it was planned with and
    continues at its final rate, never jumping back up (a ``constant``
    schedule thus continues exactly as an uninterrupted longer run).
    """
    lr, warm = cfg.learning_rate, cfg.warmup_steps
    total = cfg.steps if schedule_steps is None else schedule_steps
    step = min(step, max(total, warm))
    if warm > 0 and step <= warm:
        return lr * step / warm
    if cfg.schedule == "constant" or total <= warm:
        return lr
    progress = min(max((step - warm) / max(total - warm, 1), 0.0), 1.0)
    floor = cfg.min_lr_ratio * lr
    if cfg.schedule == "linear":
        return lr - (lr - floor) * progress
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


def extension_notice(step: int, cfg: TrainConfig, schedule_steps: int) -> str:
    """What a run resumed at ``step`` with ``cfg.steps`` past its planned ``schedule_steps`` does with the
    rate (:func:`learning_rate`): warmup, if unfinished, still runs to ``warmup_steps``; then it holds."""
    held_from = max(schedule_steps, cfg.warmup_steps)
    final = learning_rate(held_from, cfg, schedule_steps)
    head = f"train.steps {cfg.steps} is past the {schedule_steps} steps this run's schedule was planned for: "
    first = max(step, schedule_steps) + 1
    if held_from >= cfg.steps:
        return head + f"warmup continues to step {cfg.steps}, its last"
    if held_from >= first:
        return head + (f"warmup continues to step {held_from}, then steps {held_from + 1}-{cfg.steps} hold "
                       f"its final learning rate {final:.3g}")
    return head + f"steps {first}-{cfg.steps} hold its final learning rate {final:.3g}"
