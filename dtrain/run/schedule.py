"""The learning rate as a pure function of the optimizer step."""

from __future__ import annotations

import math

from ..config import TrainConfig


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (1-based).

    Linear warmup from ``lr / warmup_steps`` to ``lr`` over ``warmup_steps``,
    then ``constant``, ``linear`` decay or ``cosine`` decay to
    ``min_lr_ratio * lr`` at the last step (``cfg.steps``).
    """
    lr, warm, total = cfg.learning_rate, cfg.warmup_steps, cfg.steps
    if warm > 0 and step <= warm:
        return lr * step / warm
    if cfg.schedule == "constant" or total <= warm:
        return lr
    progress = min(max((step - warm) / max(total - warm, 1), 0.0), 1.0)
    floor = cfg.min_lr_ratio * lr
    if cfg.schedule == "linear":
        return lr - (lr - floor) * progress
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))
