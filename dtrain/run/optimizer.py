"""The optimizer step: global-norm clipping, the finiteness check and AdamW, as one function.

The hundreds of LoRA arrays of a model make mlx's ``Optimizer.update`` thousands of
tiny eager operations, a large share of a GPU step (docs/benchmarks.md). Here the
clip, the AdamW update of :class:`mlx.optimizers.AdamW` and the skip of a
non-finite step are one pure function of ``(params, state, grads, lr,
loss_finite)``, compiled once per run with ``mx.compile`` (the LoRA shapes never
change). The skip is decided on the device: the update is computed and
``mx.where`` keeps the old parameters and optimizer state (step counter and
learning rate included) when the loss or the gradient norm is not finite, so
the host reads the norm once, after the update, instead of waiting for it
before. The gradients are already summed over ranks, so every rank computes the
same norm and takes the same decision.

Uncompiled (``train.compile_optimizer: false``, and ``auto`` on the CPU) it is
the eager path: the host reads the norm, then updates or skips. On the CPU the
compiled step's first run on a machine builds C++ kernels, which costs more than a
short run gains (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from ..config import TrainConfig
from ..device import on_gpu
from .schedule import learning_rate


class AdamWStep:
    """AdamW with clipping and the non-finite skip; holds the run's optimizer state.

    ``state`` is the :class:`mlx.optimizers.AdamW` state (``step``,
    ``learning_rate``, ``m``/``v`` per parameter), which checkpoints save and
    restore as they would the optimizer's own.

    Args:
        cfg: ``train`` config: ``weight_decay``, ``grad_clip``,
            ``compile_optimizer`` and the schedule (the initial learning rate).
        params: the trainable parameter tree, for the state's shapes.
    """

    def __init__(self, cfg: TrainConfig, params: dict):
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

    def apply(self, model, grads: dict, lr: float, loss_finite: bool) -> float:
        """Clip ``grads``, and unless the step is non-finite, update ``model``'s LoRA and the state.

        Evaluates the update: compiled, this is the step's one wait for the device.

        Args:
            model: the model; its ``trainable_parameters()`` match ``grads``.
            grads: gradient tree, summed over ranks (same values on every rank).
            lr: this step's learning rate.
            loss_finite: whether the step's loss (all-reduced) is finite.
        Returns:
            The global L2 norm of ``grads`` before clipping. The update was
            applied iff ``loss_finite`` and the norm is finite (:func:`update_applied`).
        """
        if self.compiled is None:  # eager: wait for the norm, then update or skip
            grads, norm = self._clip(grads)
            norm, params = float(norm), []
            if update_applied(loss_finite, norm):
                self.adamw.learning_rate = lr
                params = self.adamw.apply_gradients(grads, model)  # = adamw.update(model, grads)
                model.update(params)
        else:
            params, state, norm = self.compiled(model.trainable_parameters(), self.adamw.state, grads,
                                                mx.array(lr, mx.float32), mx.array(loss_finite))
            model.update(params)
            self.adamw.state = state
        mx.eval(norm, params, self.adamw.state)  # the new arrays themselves: no walk over the model
        return float(norm)

    def _clip(self, grads: dict):
        """``(clipped grads, norm before clipping)``; the grads unchanged when ``grad_clip`` is 0."""
        if self.grad_clip > 0:
            return optim.clip_grad_norm(grads, self.grad_clip)
        return grads, mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for _, g in tree_flatten(grads)))

    def _pure(self, params: dict, state: dict, grads: dict, lr: mx.array, loss_finite: mx.array):
        """``(new params, new state, grad norm)``; old params and state where the step is not finite."""
        grads, norm = self._clip(grads)
        ok = mx.logical_and(loss_finite, mx.isfinite(norm))
        adamw = copy.copy(self.adamw)  # the same hyperparameters; its own state (apply_gradients writes into it)
        adamw.state = tree_map(lambda a: a, state)  # new containers, the same arrays
        adamw.state["learning_rate"] = lr  # as the ``learning_rate`` setter stores it: a float32 scalar
        new_params = adamw.apply_gradients(grads, params)
        return _select(ok, params, new_params), _select(ok, state, adamw.state), norm


def _select(ok: mx.array, old, new):
    """``old``'s tree with each array replaced by ``new``'s at the same path where ``ok``.

    Matched by path, not by structure: the trees may differ in empty containers
    (``apply_gradients`` adds placeholders that a restored state or a gradient tree lacks).
    """
    new = dict(tree_flatten(new))
    return tree_map_with_path(lambda path, a: mx.where(ok, new[path], a) if path in new else a, old)


def update_applied(loss_finite: bool, grad_norm: float) -> bool:
    """Whether :meth:`AdamWStep.apply` updated: the decision it took on the device, read on the host."""
    return loss_finite and math.isfinite(grad_norm)
