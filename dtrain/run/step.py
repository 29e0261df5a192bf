"""One optimizer step: global batch -> engine -> all-reduce -> schedule, clip + AdamW -> metrics.

:class:`Step` is built once by ``trainer.setup``; the loop calls it once per
step. It asks the sampler once (the global batch and this rank's micro-batches),
counts the batch's ``Totals`` (``engine.batch_totals``), asks the engine once per
micro-batch (``run_micro_batches``) and the objective once, at the end, for the
metrics (its hyper-parameters are asked when built), and every rank joins one
all-reduce (``Group.all_sum``): the gradients, the metric sums and the stop flag
together; ``perf/allreduce_seconds`` times it (flattening and splitting included).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_map

from ..config import TrainConfig
from ..distributed import Group
from ..engine import Objective, batch_totals, run_micro_batches
from ..memory import trim_cache
from ..sampler import Sampler
from .tracking import peak_memory_gb


def step_seed(seed: int, step: int) -> int:
    """The dropout key seed of an optimizer step, so a resumed run draws the same masks."""
    return (seed * 1_000_003 + step) % (2**63)


def dropout_key(seed: int, step: int, rank: int) -> mx.array:
    """LoRA dropout's key for ``rank``'s share of step ``step``: a pure function of the three, so a
    resumed run draws the same masks. Rank 0 takes the step's own key (a one-rank run is as before);
    each other rank one of its own, not a split of the step's key (rank 0 splits that into its
    micro-batches' keys, ``split(key, rank + 1)[rank]`` among them): ranks that draw the same masks on
    their different pairs do not average their noise out in the all-reduce."""
    return mx.random.key(step_seed(seed, step) + (rank << 32))


def padding_fraction(sums: dict) -> float:
    """Share of the tokens computed that are padding: ``1 - input_tokens / computed_tokens``
    over a step's summed layout counts (all micro-batches and ranks); 0 when nothing ran."""
    computed = sums["computed_tokens"]
    return 1.0 - sums["input_tokens"] / computed if computed > 0 else 0.0


@dataclass
class StepOutcome:
    """What one step did: ``metrics`` (TRL names plus the step's own), ``applied`` (False:
    the loss, gradients or updated weights were not finite and the update was skipped, the same
    decision on every rank), ``stop`` (some rank asked to stop, agreed on every rank), ``batch`` (the
    global batch's pairs)."""

    metrics: dict
    applied: bool
    stop: bool
    batch: list


@dataclass
class Step:
    """The work of one optimizer step (this rank trains its shard of the global batch).

    ``objective``: scores the step (``engine.objective`` unless given); ``hyper``: its
    hyper-parameters (``objective.hyper()`` unless given), float32 scalars that enter the
    engine as inputs, so setting a new λ here between steps retraces nothing (the
    dynamic-λ controller does: ``run.lambda_control.steer``); logged as ``train/<name>``.
    """

    engine: Any
    model: Any
    optimizer: Any
    sampler: Sampler
    pairs: list
    train: TrainConfig
    group: Group
    objective: Optional[Objective] = None
    hyper: Optional[dict] = None
    memory_budget: float = math.inf  # bytes a run may hold, MLX's buffer cache included (memory.trim_cache)

    def __post_init__(self):
        self.objective = self.objective or self.engine.objective
        self.hyper = self.hyper or self.objective.hyper()

    def __call__(self, step: int, stop=None) -> StepOutcome:
        """Step ``step`` (1-based). ``stop`` (a ``stop.StopRequest`` or None) is read after the
        micro-batches and all-reduced with the gradients: a signal during them is agreed in this step."""
        t, group, objective = self.train, self.group, self.objective
        start = time.perf_counter()
        trim_cache(self.memory_budget)  # the last step's and evaluation's arrays are freed by now
        cache_gb = mx.get_cache_memory() / 1e9
        batch, chunks = self.sampler.take(step, self.pairs, group.rank, group.size, t.micro_batch_pairs)
        totals = batch_totals(batch, objective.nll_scope)
        key = dropout_key(t.seed, step, group.rank)  # LoRA dropout's masks
        sums, grads = run_micro_batches(self.engine, chunks, totals, True, key, self.hyper)
        if grads is None:  # this rank got no pairs this step: contribute zeros
            grads = tree_map(mx.zeros_like, self.model.trainable_parameters())
        sums = {**sums, "stop": float(stop is not None and stop.requested)}
        reduce_start = time.perf_counter()
        grads, sums = group.all_sum(grads, sums, step)  # one collective, evaluated inside: this times it alone
        reduce_seconds = time.perf_counter() - reduce_start
        metrics = objective.finalize(sums, "", self.hyper)
        loss_finite = math.isfinite(metrics["loss"])
        # schedule, clip + AdamW; skipped if the loss, the gradient or the updated weights are not finite
        grad_norm, lr, applied = self.optimizer.step(self.model, grads, step, loss_finite)
        seconds = time.perf_counter() - start
        metrics.update({
            "grad_norm": grad_norm,
            "learning_rate": lr,
            "tokens_per_second": sum(p.sequence_tokens for p in batch) / seconds,  # the same for every engine's layout
            "pairs_per_second": sums["pairs"] / seconds,
            "peak_memory_gb": peak_memory_gb(),
            "perf/cache_memory_gb": cache_gb,  # freed buffers MLX kept for reuse when the step began
            "perf/step_seconds": seconds,
            "perf/allreduce_seconds": reduce_seconds,
            "prefix_sharing/fallback_pairs": sums["fallback_pairs"],
            "perf/padding_fraction": padding_fraction(sums),
            **{f"train/{name}": float(v) for name, v in self.hyper.items()},  # ORPO: train/lambda
        })
        return StepOutcome(metrics, applied, sums["stop"] > 0, batch)
