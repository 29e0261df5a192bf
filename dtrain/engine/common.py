"""The engine contract and what every engine shares: the result type, the loss
from per-token log-probabilities, and the sum over micro-batches.

An engine (``ReferenceEngine``, ``SegmentedEngine``) is built for one model and
one objective (``engine.objective.Objective``, e.g. ``loss.ORPO``) and answers
two questions about a micro-batch of pairs (see :class:`Engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
from mlx.utils import tree_map

from ..types import TokenizedPair
from .layout import Layout
from .objective import COUNT_KEYS, PairLogps, Totals


@dataclass
class StepResult:
    """What an engine returns for one micro-batch.

    ``loss``: scalar contribution to the global loss (see ``orpo_loss``);
    ``sums``: the objective's ``metric_keys`` (float32 scalars, the
    ``COUNT_KEYS`` as Python floats); ``grads``: LoRA gradient tree shaped like
    ``model.trainable_parameters()`` (None for evaluation).
    """

    loss: mx.array
    sums: dict
    grads: dict | None = None


class Engine(Protocol):
    """What the trainer asks of an engine (built by ``dtrain.engine.make_engine``).

    ``totals`` are the global counts of the step (``objective.Totals``); ``key`` is
    an ``mx.random.key`` for LoRA dropout (``dtrain.lora.DropoutKeys``; None
    without dropout): the same key gives the same masks, in either engine (placed on other tokens in MoE
    layers that sort tokens by expert: docs/architecture.md);
    ``hyper``: the objective's hyper-parameters as float32 scalars (None: its own,
    ``objective.hyper()``).
    """

    name: str
    objective: object

    def layout(self, pairs: list[TokenizedPair]) -> Layout:
        """The token rows, targets and role weights this engine runs for ``pairs``."""

    def step(self, pairs: list[TokenizedPair], totals: Totals, key: mx.array | None = None,
             hyper: dict | None = None) -> StepResult:
        """Loss contribution, metric sums and LoRA gradients of one micro-batch."""

    def evaluate(self, pairs: list[TokenizedPair], totals: Totals, key: mx.array | None = None,
                 hyper: dict | None = None) -> StepResult:
        """Loss contribution and metric sums, without gradients."""


def loss_from_token_logps(token_logps: mx.array, layout: Layout, objective, totals: Totals, hyper: dict):
    """The objective's ``(loss, sums)`` of a layout from the log-probabilities of its target tokens.

    ``token_logps``: ``(N,)`` float32, ``log p(targets[i] | context of rows[i])``;
    they are summed per pair and role into ``objective.PairLogps``.
    """
    B = layout.n_pairs
    dt = token_logps.dtype
    chosen = mx.zeros((B,), dt).at[layout.pair_of].add(token_logps * layout.w_chosen.astype(dt))
    rejected = mx.zeros((B,), dt).at[layout.pair_of].add(token_logps * layout.w_rejected.astype(dt))
    nll_sum = -(token_logps * layout.w_nll.astype(dt)).sum()
    logps = PairLogps(chosen, rejected, layout.chosen_len.astype(dt), layout.rejected_len.astype(dt), nll_sum,
                      layout.extra)
    return objective.loss(logps, totals, hyper)


def with_key(stream, key: mx.array | None) -> None:
    """Set the model's dropout key stream (``dtrain.lora.DropoutKeys``, None without dropout)
    to ``key``; engines clear it after a step so that a stray draw fails instead of reusing it."""
    if stream is not None:
        stream.key = key


def layout_counts(layout: Layout) -> dict:
    """Host-side counts of a layout, as metric sums (``COUNT_KEYS``)."""
    counts = (layout.n_pairs, layout.nll_tokens, layout.input_tokens, layout.fallback_pairs, layout.computed_tokens)
    return {k: float(v) for k, v in zip(COUNT_KEYS, counts)}


def run_micro_batches(engine: Engine, chunks: list[list[TokenizedPair]], totals: Totals, with_grads: bool,
                      key: mx.array | None = None, hyper: dict | None = None):
    """Sum ``engine.step`` (or ``evaluate``) results over the micro-batches ``chunks``.

    ``key``: split into one dropout key per micro-batch (None: no dropout).
    Returns:
        ``(sums, grads)``: every ``engine.objective.metric_keys`` sum as a Python
        float (zeros without chunks) and the summed gradient tree (None without
        grads or chunks).
    """
    keys = list(mx.random.split(key, len(chunks))) if key is not None and chunks else [None] * len(chunks)
    sums, grads, device = dict.fromkeys(engine.objective.metric_keys, 0.0), None, {}
    for chunk, k in zip(chunks, keys):
        result = (engine.step if with_grads else engine.evaluate)(chunk, totals, k, hyper)
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
