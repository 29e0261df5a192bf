"""Held-out evaluation: ``eval/`` metrics over the valid pairs, each rank taking its
micro-batches, the metric sums added over ranks and finalised by the engine's objective."""

from __future__ import annotations

from typing import Optional

from .. import sampler
from . import guards
from ..engine import batch_totals, run_micro_batches
from ..types import TokenizedPair, example_noun

ACCURACY = "eval/rewards/accuracies"  # share of held-out pairs whose chosen response is preferred


def evaluate(engine, model, pairs: list[TokenizedPair], micro: int, group, step: int, bar=None,
             hyper: dict | None = None, stop=None) -> tuple[Optional[dict], bool]:
    """``eval/`` metrics over held-out ``pairs``, each rank taking its micro-batches, and whether a
    rank was asked to stop meanwhile (``stop``: a ``stop.StopRequest`` or None; agreed with the
    metric sums, as a step agrees it). A rank asked to stop skips its remaining micro-batches, and
    a stopped evaluation gives no metrics (None): they would cover only part of the pairs.

    ``micro``: pairs per micro-batch, cut as DPO's reference pass cuts them
    (:func:`~dtrain.sampler.dealt_batches`: at step 0 the policy's log-probs then
    equal the reference's bit for bit, and the rewards are exactly 0);
    ``group``: the ``distributed.Group`` whose ranks sum the metric sums (every rank joins); ``bar``: a progress bar
    advanced by the pairs of each micro-batch (rank 0's); ``hyper``: the
    objective's hyper-parameters (the step's, ``step.Step.hyper``; None: ``objective.hyper()``).
    """
    objective = engine.objective
    totals = batch_totals(pairs, objective.nll_scope)
    sums = dict.fromkeys(objective.metric_keys, 0.0)
    model.eval()
    try:  # training mode back even on an error: a caller that goes on trains with its dropout
        for chunk in sampler.dealt_batches(pairs, group.rank, group.size, micro):
            if stop is not None and stop.requested:  # every rank still joins the one collective below
                break
            part, _ = run_micro_batches(engine, [chunk], totals, False, None, hyper)  # one read per chunk, for the bar
            sums = {k: sums[k] + part[k] for k in sums}
            if bar is not None:
                bar.update(len(chunk))
    finally:
        model.train()
    sums["stop"] = float(stop is not None and stop.requested)
    sums = group.all_sum_scalars(sums, step, "all_sum of eval metrics")
    if sums["stop"] > 0:
        return None, True
    return objective.finalize(sums, "eval/", hyper), False


def evaluate_and_log(run, step: int, may_stop: bool = True) -> bool:
    """Evaluate the held-out pairs after ``step`` (its own bar), keep and log the metrics
    (``run``: the trainer's ``Run``); True when a signal asked the run to stop meanwhile
    (``may_stop``): the evaluation is then cut short and nothing is kept."""
    mine = sampler.dealt_batches(run.valid, run.group.rank, run.group.size, run.cfg.train.micro_batch_pairs)
    noun = example_noun(run.cfg.objective.kind)
    bar = run.log.eval_bar(step, sum(map(len, mine)), noun)
    run.log.doing(f"eval at step {step}: {len(run.valid)} held-out {noun}{'s' if len(run.valid) != 1 else ''}")
    try:
        metrics, stopped = evaluate(run.engine, run.model, run.valid, run.cfg.train.micro_batch_pairs, run.group,
                                    step, bar, run.step.hyper, run.stop if may_stop else None)
    finally:
        if bar is not None:
            bar.close()
    if stopped:
        return True
    run.result.evals[step] = metrics
    run.state.evals[str(step)] = metrics
    run.log.scalars(step, metrics)
    # the guard's margin is nats/token; DPO sigmoid/hinge log logps/chosen as a sum per response (TRL): not checked
    per_token = getattr(run.engine.objective, "per_token_logps", True)
    drop = (guards.chosen_logps_drop(run.state.evals, run.cfg.train.chosen_logps_drop_warn, run.cfg.objective.kind,
                                     run.cfg.orpo.lambda_schedule == "adaptive") if per_token else None)
    for warning in (drop, guards.non_finite_eval(metrics, step, run.cfg.objective.kind)):
        if warning:
            run.log.message(warning)
    return stopped
