"""The engine contract and what every engine shares: the global totals, the
result type, the loss from per-token log-probabilities, and the sum over
micro-batches.

An engine (``ReferenceEngine``, ``SegmentedEngine``) is built for one model and
one objective (``dtrain.objective.ORPO``) and answers two questions about a
micro-batch of pairs (see :class:`Engine`). The objective is duck-typed here
(``nll_scope``, ``loss``, ``metric_keys``) so that the engine package imports
no module above it that imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
from mlx.utils import tree_map

from ..sampler import micro_batches
from ..types import TokenizedPair
from .layout import Layout


@dataclass
class Norm:
    """Global totals of one optimizer step (all micro-batches, all ranks), from
    ``objective.totals(global_batch)``.

    The loss of a micro-batch is divided by these, so summing micro-batch
    gradients over accumulation steps and ranks gives the global-batch gradient.
    ``lam``: the step's λ as an input (a float32 scalar array, so a compiled
    function is not traced again when it changes); None: the objective's own.
    """

    nll_tokens: float
    pairs: float
    lam: mx.array | None = None

    def arrays(self) -> tuple:
        """The totals as float32 scalar arrays, for a compiled function (``Norm(*arrays)`` rebuilds them)."""
        counts = (mx.array(self.nll_tokens, mx.float32), mx.array(self.pairs, mx.float32))
        return counts if self.lam is None else (*counts, self.lam)


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


class Engine(Protocol):
    """What the trainer asks of an engine (built by ``dtrain.engine.make_engine``).

    ``totals`` are the global counts of the step (:class:`Norm`); ``key`` is an
    ``mx.random.key`` for LoRA dropout (``dtrain.lora.DropoutKeys``; None
    without dropout): the same key gives the same masks, in either engine.
    """

    name: str
    objective: object

    def layout(self, pairs: list[TokenizedPair]) -> Layout:
        """The token rows, targets and role weights this engine runs for ``pairs``."""

    def step(self, pairs: list[TokenizedPair], totals: Norm, key: mx.array | None = None) -> StepResult:
        """Loss contribution, metric sums and LoRA gradients of one micro-batch."""

    def evaluate(self, pairs: list[TokenizedPair], totals: Norm, key: mx.array | None = None) -> StepResult:
        """Loss contribution and metric sums, without gradients."""


def loss_from_token_logps(token_logps: mx.array, layout: Layout, objective, totals: Norm):
    """The objective's loss of a layout from the log-probabilities of its target tokens.

    Args:
        token_logps: ``(N,)`` float32, ``log p(targets[i] | context of rows[i])``.
        layout: the layout the rows and role weights come from.
        objective: ``objective.loss(chosen, rejected, nll_sum, totals)``, e.g. ``ORPO``.
        totals: global counts.

    Returns:
        ``(loss, sums)`` as ``objective.loss`` returns them: the per-pair mean
        log-probabilities of the chosen and rejected responses ``(B,)`` and the
        summed NLL of the ``w_nll`` targets go in.
    """
    B = layout.n_pairs
    dt = token_logps.dtype
    chosen = mx.zeros((B,), dt).at[layout.pair_of].add(token_logps * layout.w_chosen.astype(dt))
    rejected = mx.zeros((B,), dt).at[layout.pair_of].add(token_logps * layout.w_rejected.astype(dt))
    nll_sum = -(token_logps * layout.w_nll.astype(dt)).sum()
    return objective.loss(chosen / layout.chosen_len.astype(dt), rejected / layout.rejected_len.astype(dt),
                          nll_sum, totals)


def with_key(stream, key: mx.array | None) -> None:
    """Set the model's dropout key stream (``dtrain.lora.DropoutKeys``, None without dropout)
    to ``key``; engines clear it after a step so that a stray draw fails instead of reusing it."""
    if stream is not None:
        stream.key = key


def layout_counts(layout: Layout) -> dict:
    """Host-side counts of a layout, as metric sums."""
    return {
        "pairs": float(layout.n_pairs),
        "nll_tokens": float(layout.nll_tokens),
        "input_tokens": float(layout.input_tokens),
        "fallback_pairs": float(layout.fallback_pairs),
    }


def run_micro_batches(engine: Engine, pairs: list[TokenizedPair], totals: Norm, micro: int, with_grads: bool,
                      key: mx.array | None = None):
    """Sum ``engine.step`` (or ``evaluate``) results over micro-batches of ``micro`` pairs.

    ``key``: split into one dropout key per micro-batch (None: no dropout).
    Returns:
        ``(sums, grads)``: every ``engine.objective.metric_keys`` sum as a Python
        float (zeros when ``pairs`` is empty) and the summed gradient tree
        (None without grads or pairs).
    """
    chunks = micro_batches(pairs, micro)
    keys = list(mx.random.split(key, len(chunks))) if key is not None and chunks else [None] * len(chunks)
    sums, grads, device = dict.fromkeys(engine.objective.metric_keys, 0.0), None, {}
    for chunk, k in zip(chunks, keys):
        result = engine.step(chunk, totals, k) if with_grads else engine.evaluate(chunk, totals, k)
        if with_grads:
            grads = result.grads if grads is None else tree_map(lambda a, b: a + b, grads, result.grads)
        for name, v in result.sums.items():  # device sums stay on the device; host counts add here
            if isinstance(v, mx.array):
                device[name] = device[name] + v if name in device else v
            else:
                sums[name] += v
        mx.eval(result.loss, list(device.values()), grads)  # one sync per micro-batch bounds memory
    if device:  # one read for all of them
        for name, v in zip(device, mx.stack(list(device.values())).tolist()):
            sums[name] += v
    return sums, grads
