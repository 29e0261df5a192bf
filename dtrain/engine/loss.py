"""The ORPO objective, as pure functions: arrays in, ``(loss, metric sums)`` out.

Source: Hong, Lee & Thorne, "ORPO: Monolithic Preference Optimization without
Reference Model" (2024), eq. 4-7; metric names and the reward definition follow
TRL's ``ORPOTrainer`` (``rewards/chosen = lambda * logps/chosen``).

    L = L_NLL + lambda * mean_pairs(softplus(-log_odds))
    log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))

where ``lw``/``lr`` are the length-normalised (mean) log-probabilities of the
chosen/rejected response tokens. Losses are returned as *sums over this
micro-batch divided by global counts*, so that summing them over micro-batches
and ranks gives the loss of the whole global batch (see :func:`orpo_loss`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .objective import COUNT_KEYS, PairLogps, Totals

# The additive sums orpo_loss returns, in this order (ORPO.metric_keys).
ORPO_SUM_KEYS = ("nll_sum", "or_sum", "log_odds_ratio_sum", "log_odds_chosen_sum", "logps_chosen_sum",
                 "logps_rejected_sum", "accuracy_sum")

# Mean log-probabilities are clamped to at most this value before log1mexp:
# at exactly 0 the odds are infinite and the gradient would be inf/NaN.
LOGP_CEILING = -1e-7


def upcast(x: mx.array) -> mx.array:
    """``x`` in float32, or unchanged when it is already float32 or float64.

    Low-precision (bf16/fp16) values are promoted; float64 is kept so that
    finite-difference tests can run the whole loss in double precision.
    """
    return x if x.dtype in (mx.float32, mx.float64) else x.astype(mx.float32)


def log1mexp(x: mx.array) -> mx.array:
    """``log(1 - exp(x))`` for ``x <= 0``, stable at both ends.

    Two branches (Maechler 2012, "Accurately computing log(1 - exp(-|a|))"):
    ``log(-expm1(x))`` for ``x > -ln 2`` and ``log1p(-exp(x))`` otherwise.
    Each branch sees a safe input so that the branch *not* taken cannot put
    inf/NaN into the gradient of ``mx.where``. Inputs above ``LOGP_CEILING`` are
    clamped to it (zero gradient there), so ``x -> 0-`` gives finite values.

    Args:
        x: float32 array of any shape, values <= 0 (log-probabilities).
    Returns:
        Array of the same shape.
    """
    x = mx.minimum(upcast(x), LOGP_CEILING)
    near = x > -math.log(2.0)
    x_near = mx.where(near, x, -1.0)
    x_far = mx.where(near, -1.0, x)
    return mx.where(near, mx.log(-mx.expm1(x_near)), mx.log1p(-mx.exp(x_far)))


def log_odds(chosen_logps: mx.array, rejected_logps: mx.array) -> mx.array:
    """Log odds ratio ``log(odds(yw|x) / odds(yl|x))`` per pair (ORPO eq. 5).

    Args:
        chosen_logps, rejected_logps: ``(B,)`` mean log-probabilities (nats/token).
    Returns:
        ``(B,)`` float32.
    """
    lw, lr = upcast(chosen_logps), upcast(rejected_logps)
    return (lw - lr) - (log1mexp(lw) - log1mexp(lr))


def orpo_loss(
    chosen_logps: mx.array,
    rejected_logps: mx.array,
    nll_sum: mx.array,
    lam: float,
    n_tokens: float,
    n_pairs: float,
    pair_mask: mx.array | None = None,
) -> tuple[mx.array, dict]:
    """ORPO loss contribution of one micro-batch, normalised by global counts.

    Args:
        chosen_logps, rejected_logps: ``(B,)`` mean response log-probabilities.
        nll_sum: scalar, summed negative log-likelihood (nats) of the NLL tokens
            of this micro-batch's chosen sequences.
        lam: λ, the weight of the odds-ratio term (a float or a float32 scalar).
        n_tokens: NLL token count of the *global* batch (all micro-batches, all ranks).
        n_pairs: pair count of the global batch.
        pair_mask: optional ``(B,)`` 1/0 weights; 0 marks padding pairs.

    Returns:
        ``(loss, sums)``: ``loss`` is ``nll_sum / n_tokens + lam * sum(or) / n_pairs``
        (summing it over micro-batches and ranks gives the global loss), and
        ``sums`` holds per-micro-batch sums for metrics (see :func:`finalize_metrics`).
    """
    lw, lr = upcast(chosen_logps), upcast(rejected_logps)
    mask = mx.ones(lw.shape, lw.dtype) if pair_mask is None else pair_mask.astype(lw.dtype)
    lo = log_odds(lw, lr)
    or_term = nn.softplus(-lo)  # = -log sigmoid(log_odds)
    loss = upcast(nll_sum) / n_tokens + lam * (or_term * mask).sum() / n_pairs
    sums = dict(zip(ORPO_SUM_KEYS, (upcast(nll_sum), (or_term * mask).sum(), (-or_term * mask).sum(),
                                    (lo * mask).sum(), (lw * mask).sum(), (lr * mask).sum(),
                                    ((lw > lr).astype(lw.dtype) * mask).sum())))
    return loss, sums


def finalize_metrics(sums: dict, lam: float, prefix: str = "") -> dict:
    """Turn summed metrics (over micro-batches and ranks) into TRL-named means.

    ``sums`` needs the keys of :func:`orpo_loss` plus ``pairs`` and
    ``nll_tokens`` (counts). Rewards are ``lam * logps`` as in TRL;
    ``rewards/accuracies`` compares the log-probabilities themselves, so it is
    still meaningful at ``lam = 0``.

    Returns:
        dict of Python floats: ``loss``, ``nll_loss``, ``log_odds_ratio``,
        ``log_odds_chosen``, ``rewards/chosen``, ``rewards/rejected``,
        ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
        ``logps/rejected``, each under ``prefix``.
    """
    s = {k: float(v) for k, v in sums.items()}
    pairs = max(s["pairs"], 1.0)
    nll = s["nll_sum"] / max(s["nll_tokens"], 1.0)
    chosen, rejected = s["logps_chosen_sum"] / pairs, s["logps_rejected_sum"] / pairs
    out = {
        "loss": nll + lam * s["or_sum"] / pairs,
        "nll_loss": nll,
        "log_odds_ratio": s["log_odds_ratio_sum"] / pairs,
        "log_odds_chosen": s["log_odds_chosen_sum"] / pairs,
        "rewards/chosen": lam * chosen,
        "rewards/rejected": lam * rejected,
        "rewards/accuracies": s["accuracy_sum"] / pairs,
        "rewards/margins": lam * (chosen - rejected),
        "logps/chosen": chosen,
        "logps/rejected": rejected,
    }
    return {prefix + k: v for k, v in out.items()}


@dataclass(frozen=True)
class ORPO:
    """ORPO (Hong et al. 2024, eq. 6) as an ``engine.objective.Objective``.

    Args:
        lam: λ, the weight of the odds-ratio term (``orpo.lambda``).
        nll_scope: ``full`` (NLL over prompt and chosen response) or ``response``.
    """

    lam: float
    nll_scope: str = "full"

    metric_keys = ORPO_SUM_KEYS + COUNT_KEYS

    @classmethod
    def from_config(cls, cfg) -> "ORPO":
        """The objective of a run's ``Config`` (its ``orpo`` section)."""
        return cls(cfg.orpo.lam, cfg.orpo.nll_scope)

    def hyper(self) -> dict:
        """``{"lambda": λ}`` as a float32 scalar, a step input (named as the config key ``orpo.lambda``)."""
        return {"lambda": mx.array(self.lam, mx.float32)}

    def loss(self, logps: PairLogps, totals: Totals, hyper: dict):
        """``(loss, sums)`` of one micro-batch (:func:`orpo_loss` on the mean response log-probabilities)."""
        return orpo_loss(logps.chosen / logps.chosen_tokens, logps.rejected / logps.rejected_tokens, logps.nll_sum,
                         hyper["lambda"], totals.nll_tokens, totals.pairs)

    def finalize(self, sums: dict, prefix: str = "", hyper: dict | None = None) -> dict:
        """Summed values (over micro-batches and ranks) -> TRL-named metrics (:func:`finalize_metrics`),
        the rewards weighted by the λ of ``hyper`` (the step's; None: ``self.lam``)."""
        return finalize_metrics(sums, self.lam if hyper is None else float(hyper["lambda"]), prefix)
