"""The optimizer step: global-norm clipping, the finiteness check and AdamW, as one function.

The ~420 LoRA arrays of a SmolLM2-sized model make ``optimizer.update`` about
4,000 tiny eager operations, a third of a GPU step (docs/gpu.md). Here the
clip, the AdamW update of :class:`mlx.optimizers.AdamW` and the skip of a
non-finite step are one pure function of ``(params, state, grads, lr,
loss_finite)``, compiled once per run with ``mx.compile`` (the LoRA shapes never
change). The skip is decided on the device: the update is computed and
``mx.where`` keeps the old parameters and optimizer state (step counter and
learning rate included) when the loss or the gradient norm is not finite, so
the host reads the norm once, after the update, instead of waiting for it
before. The gradients are already summed over ranks, so every rank computes the
same norm and takes the same decision.
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from .config import TrainConfig
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
        self._apply = mx.compile(self._pure) if cfg.compile_optimizer else self._pure

    @property
    def state(self) -> dict:
        return self.adamw.state

    @state.setter
    def state(self, state: dict) -> None:
        self.adamw.state = state

    def apply(self, model, grads: dict, lr: float, loss_finite: bool) -> mx.array:
        """Clip ``grads``, and unless the step is non-finite, update ``model``'s LoRA and the state.

        Args:
            model: the model; its ``trainable_parameters()`` match ``grads``.
            grads: gradient tree, summed over ranks (same values on every rank).
            lr: this step's learning rate.
            loss_finite: whether the step's loss (all-reduced) is finite.
        Returns:
            The global L2 norm of ``grads`` before clipping (float32 or the grads'
            dtype, shape ``()``), lazy: the parameters and state are lazy too; one
            ``mx.eval`` of all three reads it. The update was applied iff
            ``loss_finite`` and the norm is finite (:func:`applied`).
        """
        params, state, norm = self._apply(model.trainable_parameters(), self.adamw.state, grads,
                                          mx.array(lr, mx.float32), mx.array(loss_finite))
        model.update(params)
        self.adamw.state = state
        return norm

    def _pure(self, params: dict, state: dict, grads: dict, lr: mx.array, loss_finite: mx.array):
        """``(new params, new state, grad norm)``; old params and state where the step is not finite."""
        if self.grad_clip > 0:
            grads, norm = optim.clip_grad_norm(grads, self.grad_clip)
        else:
            norm = mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for _, g in tree_flatten(grads)))
        ok = mx.logical_and(loss_finite, mx.isfinite(norm))
        adamw = copy.copy(self.adamw)  # the same hyperparameters; its own state (apply_gradients writes into it)
        adamw.state = tree_map(lambda a: a, state)  # new containers, the same arrays
        adamw.state["learning_rate"] = lr  # as the ``learning_rate`` setter stores it: a float32 scalar
        new_params = adamw.apply_gradients(grads, params)
        keep = lambda new, old: mx.where(ok, new, old)  # noqa: E731
        return tree_map(keep, new_params, params), tree_map(keep, adamw.state, state), norm


def applied(loss_finite: bool, grad_norm: float) -> bool:
    """Whether :meth:`AdamWStep.apply` updated: the decision it took on the device, read on the host."""
    return loss_finite and math.isfinite(grad_norm)
