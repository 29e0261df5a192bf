"""The optimizer step: the learning-rate schedule, global-norm clipping, the finiteness check and
AdamW (the last three as one function).

The hundreds of LoRA arrays of a model make mlx's ``Optimizer.update`` thousands of
tiny eager operations, a large share of a GPU step (docs/benchmarks.md). Here the
clip, the AdamW update of :class:`mlx.optimizers.AdamW` and the skip of a
non-finite step are one pure function of ``(params, state, grads, lr,
loss_finite)``, compiled once per run with ``mx.compile`` (the LoRA shapes never
change). The skip is decided on the device: the update is computed and
``mx.where`` keeps the old parameters and optimizer state (step counter and
learning rate included) when the loss, the gradient norm or the updated
weights are not finite (a learning rate near float32's range makes a finite
gradient's update inf), so the host reads the norm and the decision once,
after the update, instead of waiting for them before. The gradients are
already summed over ranks, so every rank computes the same norm and takes the
same decision.

Uncompiled (``train.compile_optimizer: false``, and ``auto`` on the CPU) it is
the eager path: the host reads the norm, then computes the update and keeps it
or skips. On the CPU the compiled step's first run on a machine builds C++
kernels, which costs more than a short run gains (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from ..config import TrainConfig
from ..device import on_gpu


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


def warmup_notice(cfg: TrainConfig) -> str:
    """What a new run whose ``warmup_steps`` is at least its ``steps`` does with the rate (:func:`learning_rate`)."""
    peak = "reaches train.learning_rate only at the last step" if cfg.warmup_steps == cfg.steps else \
        f"peaks at {cfg.steps}/{cfg.warmup_steps} of train.learning_rate"
    return (f"train.warmup_steps {cfg.warmup_steps} >= train.steps {cfg.steps}: the learning rate warms up for the "
            f"whole run, {peak} and never decays; set train.warmup_steps below train.steps")


def extension_notice(step: int, cfg: TrainConfig, schedule_steps: int) -> str:
    """What a run resumed at ``step`` with ``cfg.steps`` past its planned ``schedule_steps`` does with the
    rate (:func:`learning_rate`): warmup, if unfinished, still runs to ``warmup_steps``; then it holds."""
    held_from = max(schedule_steps, cfg.warmup_steps)
    final = learning_rate(held_from, cfg, schedule_steps)
    planned = f"{schedule_steps} step{'' if schedule_steps == 1 else 's'}"
    head = f"train.steps {cfg.steps} is past the {planned} this run's schedule was planned for: "
    first = max(step, schedule_steps) + 1
    if held_from >= cfg.steps:
        return head + f"warmup continues to step {cfg.steps}, its last"
    if held_from >= first:
        return head + (f"warmup continues to step {held_from}, then steps {held_from + 1}-{cfg.steps} hold "
                       f"its final learning rate {final:.3g}")
    steps = f"step {first} holds" if first == cfg.steps else f"steps {first}-{cfg.steps} hold"
    return head + f"{steps} its final learning rate {final:.3g}"


def shortened_notice(cfg: TrainConfig, schedule_steps: int) -> str | None:
    """What a run resumed with ``cfg.steps`` short of its planned ``schedule_steps`` ends at: the rate of its last
    step (:func:`learning_rate`), not the schedule's final one (None: the two are equal as shown, a constant rate
    or a step short of the end of a long decay)."""
    last = f"{learning_rate(cfg.steps, cfg, schedule_steps):.3g}"
    final = f"{learning_rate(schedule_steps, cfg, schedule_steps):.3g}"
    if last == final:
        return None
    return (f"train.steps {cfg.steps} ends this run before the {schedule_steps} steps its schedule was planned for: "
            f"its last step trains at learning rate {last}, not the final {final}")


def schedule_notice(cfg: TrainConfig, step: int, schedule_steps: int, resumed: bool) -> str | None:
    """What the rate does that a run starting after ``step`` may not expect, or None: a resume past its planned
    ``schedule_steps`` (:func:`extension_notice`) or short of them (:func:`shortened_notice`), a new run all
    warmup (:func:`warmup_notice`)."""
    if resumed and cfg.steps > max(schedule_steps, step):  # steps left, past the plan
        return extension_notice(step, cfg, schedule_steps)
    if resumed and step < cfg.steps < schedule_steps:  # ends before the plan does
        return shortened_notice(cfg, schedule_steps)
    if not resumed and cfg.warmup_steps >= cfg.steps:  # a new run (in the folder it holds) all warmup
        return warmup_notice(cfg)
    return None


class AdamWStep:
    """AdamW with clipping and the non-finite skip; holds the run's optimizer state.

    ``state`` is the :class:`mlx.optimizers.AdamW` state (``step``,
    ``learning_rate``, ``m``/``v`` per parameter), which checkpoints save and
    restore as they would the optimizer's own.

    Args:
        cfg: ``train`` config: ``weight_decay``, ``grad_clip``,
            ``compile_optimizer`` and the schedule (:func:`learning_rate`).
        params: the trainable parameter tree, for the state's shapes.
        plus_ratio: LoRA+ (Hayou et al. 2024): parameters named ``...lora_b`` move
            with ``plus_ratio`` times the learning rate. AdamW's step, weight decay
            included, is linear in the learning rate, so their update is scaled by it.
    """

    def __init__(self, cfg: TrainConfig, params: dict, plus_ratio: float = 1.0):
        self.cfg, self.plus_ratio = cfg, plus_ratio
        self.schedule_steps = cfg.steps  # the steps the schedule is planned for; a resume sets its run's
        # bias_correction: the standard AdamW (Loshchilov & Hutter; PyTorch, TRL); MLX defaults to off
        self.adamw = optim.AdamW(learning_rate=learning_rate(1, cfg), weight_decay=cfg.weight_decay,
                                 bias_correction=True)
        self.adamw.init(params)
        self.grad_clip = cfg.grad_clip
        compiled = cfg.compile_optimizer
        if compiled == "auto":
            compiled = on_gpu()
        self.compiled = mx.compile(self._pure) if compiled else None

    @property
    def state(self) -> dict:
        return self.adamw.state

    @state.setter
    def state(self, state: dict) -> None:
        self.adamw.state = state

    def step(self, model, grads: dict, step: int, loss_finite: bool) -> tuple[float, float, bool]:
        """Optimizer step ``step`` (1-based) at the schedule's rate: :meth:`apply` with
        ``learning_rate(step, cfg, schedule_steps)``. Returns ``(grad norm, learning rate, applied)``."""
        lr = learning_rate(step, self.cfg, self.schedule_steps)
        norm, applied = self.apply(model, grads, lr, loss_finite)
        return norm, lr, applied

    def apply(self, model, grads: dict, lr: float, loss_finite: bool) -> tuple[float, bool]:
        """Clip ``grads``, and unless the step is non-finite, update ``model``'s LoRA and the state.

        Evaluates the update: compiled, this is the step's one wait for the device.

        Args:
            model: the model; its ``trainable_parameters()`` match ``grads``.
            grads: gradient tree, summed over ranks (same values on every rank).
            lr: this step's learning rate.
            loss_finite: whether the step's loss (all-reduced) is finite.
        Returns:
            ``(norm, applied)``: the global L2 norm of ``grads`` before clipping, and whether the
            update was applied: ``loss_finite``, the norm finite and every updated weight finite.
        """
        if self.compiled is None:  # eager: wait for the norm, then update or skip
            grads, norm = self._clip(grads)
            norm, params, applied = float(norm), [], False
            if loss_finite and math.isfinite(norm):
                old, state = model.trainable_parameters(), self.adamw.state
                self.adamw.state = tree_map(lambda a: a, state)  # new containers: the old state stays for a skip
                self.adamw.learning_rate = lr
                params = self._plus(old, self.adamw.apply_gradients(grads, model))  # = adamw.update(model, grads)
                applied = _all_finite(params).item()
                if applied:
                    model.update(params)
                else:
                    self.adamw.state, params = state, []
        else:
            params, state, norm, applied = self.compiled(model.trainable_parameters(), self.adamw.state, grads,
                                                         mx.array(lr, mx.float32), mx.array(loss_finite))
            model.update(params)
            self.adamw.state = state
        mx.eval(norm, params, self.adamw.state, applied)  # the new arrays themselves: no walk over the model
        return float(norm), bool(applied)

    def _clip(self, grads: dict):
        """``(clipped grads, norm before clipping)``; the grads unchanged when ``grad_clip`` is 0."""
        if self.grad_clip > 0:
            return optim.clip_grad_norm(grads, self.grad_clip)
        return grads, mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for _, g in tree_flatten(grads)))

    def _pure(self, params: dict, state: dict, grads: dict, lr: mx.array, loss_finite: mx.array):
        """``(new params, new state, grad norm, applied)``; old params and state where the step is not finite."""
        grads, norm = self._clip(grads)
        adamw = copy.copy(self.adamw)  # the same hyperparameters; its own state (apply_gradients writes into it)
        adamw.state = tree_map(lambda a: a, state)  # new containers, the same arrays
        adamw.state["learning_rate"] = lr  # as the ``learning_rate`` setter stores it: a float32 scalar
        new_params = self._plus(params, adamw.apply_gradients(grads, params))
        ok = mx.logical_and(mx.logical_and(loss_finite, mx.isfinite(norm)), _all_finite(new_params))
        return _select(ok, params, new_params), _select(ok, state, adamw.state), norm, ok

    def _plus(self, old: dict, new: dict) -> dict:
        """``new`` with each ``lora_b`` update scaled by ``plus_ratio`` (LoRA+); ``new`` itself at 1."""
        if self.plus_ratio == 1.0:
            return new
        old = dict(tree_flatten(old))
        ratio = self.plus_ratio
        return tree_map_with_path(lambda path, p: old[path] + ratio * (p - old[path])
                                  if path.endswith("lora_b") and path in old else p, new)


def _select(ok: mx.array, old, new):
    """``old``'s tree with each array replaced by ``new``'s at the same path where ``ok``.

    Matched by path, not by structure: the trees may differ in empty containers
    (``apply_gradients`` adds placeholders that a restored state or a gradient tree lacks).
    """
    new = dict(tree_flatten(new))
    return tree_map_with_path(lambda path, a: mx.where(ok, new[path], a) if path in new else a, old)


def _all_finite(params: dict) -> mx.array:
    """Whether every weight of ``params`` is finite: a boolean scalar."""
    return mx.array([mx.isfinite(p).all() for _, p in tree_flatten(params)]).all()
