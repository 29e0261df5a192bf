"""The reference engine: ``nn.value_and_grad`` over the whole mlx-lm model.

Each pair runs as two sequences through the model's own ``__call__`` (so mlx-lm's
masks, positions and head are used unchanged) and the full ``(S, L, V)``
logits are materialised. It is the plain path the segmented engine must match.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..lora import keyed_dropout
from ..types import TokenizedPair
from .common import StepResult, layout_counts, loss_from_token_logps, with_key
from .layout import Layout, two_sequence_layout
from .loss import upcast
from .objective import Totals


def gather_token_logps(logits: mx.array, layout: Layout) -> mx.array:
    """``log softmax(logits)[rows, targets]`` in float32 (float64 kept: ``loss.upcast``).

    Args:
        logits: ``(S, L, V)`` model outputs for ``layout.tokens``.
    Returns:
        ``(N,)`` log-probabilities (nats) of the layout's target tokens.
    """
    S, L, V = logits.shape
    picked = upcast(logits.reshape(S * L, V)[layout.rows])  # (N, V)
    target = mx.take_along_axis(picked, layout.targets[:, None], axis=-1)[:, 0]
    return target - mx.logsumexp(picked, axis=-1)


class ReferenceEngine:
    """Loss, metrics and LoRA gradients by plain backpropagation.

    Implements :class:`dtrain.engine.common.Engine`.

    Args:
        model: an mlx-lm model whose LoRA parameters are the trainable ones.
        objective: the training objective (``objective.Objective``): its
            ``nll_scope`` lays out the targets, its ``loss`` scores them.

    LoRA dropout draws from ``key`` (``dtrain.lora.keyed_dropout``), module by
    module in call order: the segmented engine on the same layout draws the
    same masks from the same key.
    """

    name = "reference"

    def __init__(self, model: nn.Module, objective):
        self.model = model
        self.objective = objective
        self.dropout_keys = keyed_dropout(model)  # None without dropout

        def loss_fn(layout: Layout, totals: Totals, hyper: dict):
            logps = gather_token_logps(self.model(layout.tokens), layout)
            return loss_from_token_logps(logps, layout, self.objective, totals, hyper)

        self._loss_fn = loss_fn
        self._value_and_grad = nn.value_and_grad(model, loss_fn)

    def layout(self, pairs: list[TokenizedPair]) -> Layout:
        """The rows this engine runs for ``pairs``: two sequences per pair."""
        return two_sequence_layout(pairs, self.objective.nll_scope)

    def step(self, pairs: list[TokenizedPair], totals: Totals, key: mx.array | None = None,
             hyper: dict | None = None) -> StepResult:
        """Loss contribution, metric sums and LoRA gradients of one micro-batch (``key``: dropout)."""
        layout = self.layout(pairs)
        with_key(self.dropout_keys, key)
        (loss, sums), grads = self._value_and_grad(layout, totals, hyper or self.objective.hyper())
        with_key(self.dropout_keys, None)
        return StepResult(loss, {**sums, **layout_counts(layout)}, grads)

    def evaluate(self, pairs: list[TokenizedPair], totals: Totals, key: mx.array | None = None,
                 hyper: dict | None = None) -> StepResult:
        """Loss contribution and metric sums, without gradients."""
        layout = self.layout(pairs)
        with_key(self.dropout_keys, key)
        loss, sums = self._loss_fn(layout, totals, hyper or self.objective.hyper())
        with_key(self.dropout_keys, None)
        return StepResult(loss, {**sums, **layout_counts(layout)})
