"""The seam every objective plugs into: what an engine hands it and what it returns.

An engine reduces a micro-batch's token log-probabilities to :class:`PairLogps`
(per pair: summed log-probabilities and token counts of each response, plus any
per-pair extra inputs the pairs carry) and the summed NLL of its NLL targets;
the objective turns them, the step's :class:`Totals` and its hyper-parameters
into ``(loss, sums)``. ORPO lives in loss.py; a new objective is one file with
a class like ``loss.ORPO`` plus one line in ``dtrain.engine.OBJECTIVES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

# Host-side counts every engine adds to a micro-batch's sums (engine.common.layout_counts);
# computed_tokens: tokens through every layer, padding included (input_tokens of them are real).
COUNT_KEYS = ("pairs", "nll_tokens", "input_tokens", "fallback_pairs", "computed_tokens")


@dataclass
class Totals:
    """Global counts of one optimizer step (all micro-batches, all ranks), from
    ``layout.batch_totals(global_batch, objective.nll_scope)``: Python floats, or
    float32 scalars inside a compiled step.

    A micro-batch's loss is divided by these, so summing micro-batch gradients
    over accumulation steps and ranks gives the global-batch gradient.
    """

    nll_tokens: float
    pairs: float


@dataclass
class PairLogps:
    """What an objective scores for a micro-batch of ``B`` pairs.

    ``chosen``, ``rejected``: ``(B,)`` summed log-probabilities (nats) of each
    response's tokens; ``chosen_tokens``, ``rejected_tokens``: ``(B,)`` their
    token counts; ``nll_sum``: scalar, summed NLL of the layout's NLL targets;
    ``extra``: per-pair inputs the pairs carry (``TokenizedPair.extra``, e.g. a
    reference model's log-probabilities), name -> ``(B,)`` float32.
    """

    chosen: mx.array
    rejected: mx.array
    chosen_tokens: mx.array
    rejected_tokens: mx.array
    nll_sum: mx.array
    extra: dict = field(default_factory=dict)


class Objective(Protocol):
    """What engines and the step ask of an objective (``loss.ORPO`` is one); the registry
    (``dtrain.engine.OBJECTIVES``) builds it with the classmethod ``from_config(cfg)``.

    ``hyper()`` gives its hyper-parameters as float32 scalars: they enter a step
    as inputs (not constants), so changing one between steps retraces nothing;
    ``finalize`` gets the same ones (None: its own), for metrics that depend on them.
    Two optional class attributes (default False / True): ``needs_reference``, the
    run puts the step-0 model's summed log-probabilities into each pair's ``extra``
    first (``dtrain.run.reference``, for DPO); ``per_token_logps`` False, its
    ``logps/*`` are sums per response (DPO sigmoid and hinge), so the nats/token
    eval guard is skipped.
    """

    nll_scope: str  # which prompt tokens the layouts mark as NLL targets, and Totals counts (engine.layout.nll_tokens)
    metric_keys: tuple  # the additive sums a micro-batch returns, COUNT_KEYS included

    def hyper(self) -> dict: ...

    def loss(self, logps: PairLogps, totals: Totals, hyper: dict) -> tuple[mx.array, dict]: ...

    def finalize(self, sums: dict, prefix: str = "", hyper: dict | None = None) -> dict: ...
