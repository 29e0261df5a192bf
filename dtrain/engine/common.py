"""Pieces every engine shares: the loss from per-token log-probabilities, and
the engine's result type."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .layout import Layout
from .loss import orpo_loss


@dataclass
class Norm:
    """Global counts of one optimizer step (all micro-batches, all ranks).

    The loss of a micro-batch is divided by these, so summing micro-batch
    gradients over accumulation steps and ranks gives the global-batch gradient.
    """

    nll_tokens: float
    pairs: float


@dataclass
class StepResult:
    """What an engine returns for one micro-batch.

    ``loss``: scalar contribution to the global loss (see ``orpo_loss``);
    ``sums``: metric sums (float32 scalars), including ``pairs``, ``nll_tokens``,
    ``input_tokens`` and ``fallback_pairs``; ``grads``: LoRA gradient tree shaped
    like ``model.trainable_parameters()`` (None for evaluation).
    """

    loss: mx.array
    sums: dict
    grads: dict | None = None


def loss_from_token_logps(token_logps: mx.array, layout: Layout, lam: float, norm: Norm):
    """ORPO loss of a layout from the log-probabilities of its target tokens.

    Args:
        token_logps: ``(N,)`` float32, ``log p(targets[i] | context of rows[i])``.
        layout: the layout the rows and role weights come from.
        lam: ORPO lambda.
        norm: global counts.

    Returns:
        ``(loss, sums)`` as in :func:`dtrain.engine.loss.orpo_loss`, with the
        layout's counts added to ``sums``.
    """
    B = layout.n_pairs
    dt = token_logps.dtype
    chosen = mx.zeros((B,), dt).at[layout.pair_of].add(token_logps * layout.w_chosen.astype(dt))
    rejected = mx.zeros((B,), dt).at[layout.pair_of].add(token_logps * layout.w_rejected.astype(dt))
    nll_sum = -(token_logps * layout.w_nll.astype(dt)).sum()
    loss, sums = orpo_loss(chosen / layout.chosen_len.astype(dt), rejected / layout.rejected_len.astype(dt), nll_sum, lam, norm.nll_tokens, norm.pairs)
    return loss, sums


def layout_counts(layout: Layout) -> dict:
    """Host-side counts of a layout, as metric sums."""
    return {
        "pairs": float(layout.n_pairs),
        "nll_tokens": float(layout.nll_tokens),
        "input_tokens": float(layout.input_tokens),
        "fallback_pairs": float(layout.fallback_pairs),
    }
