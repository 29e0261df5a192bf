"""The objective seam (dtrain/engine/objective.py) and the step built on it: hyper-parameters
are step inputs, pairs carry per-pair extra inputs to the objective, a new objective is a class
plus a registry line, the sampler is asked once, and engines keep no per-step values."""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dtrain.engine import OBJECTIVES, ORPO, PairLogps, ReferenceEngine, batch_totals, make_objective, run_micro_batches
from dtrain.engine.objective import COUNT_KEYS
from dtrain.sampler import Sampler, shard_batches

from test_engine_segmented import NORM, engine_for, lora_model, make_pairs, rel


@dataclass(frozen=True)
class ToyMargin:
    """A second objective as issue 24 would add one: ``-log σ(β (c - r - ref))`` on *summed*
    log-probabilities, ``ref`` a per-pair input (``TokenizedPair.extra["ref"]``)."""

    beta: float
    nll_scope: str = "full"
    metric_keys = ("margin_sum",) + COUNT_KEYS

    def hyper(self):
        return {"beta": mx.array(self.beta, mx.float32)}

    def loss(self, logps: PairLogps, totals, hyper):
        margin = logps.chosen - logps.rejected - logps.extra["ref"]
        return (nn.softplus(-hyper["beta"] * margin)).sum() / totals.pairs, {"margin_sum": margin.sum()}

    def finalize(self, sums, prefix="", hyper=None):
        return {prefix + "margin": sums["margin_sum"] / sums["pairs"]}


def with_ref(pairs, refs):
    return [replace(p, extra={"ref": r}) for p, r in zip(pairs, refs)]


def test_orpo_is_registered_and_built_from_the_config():
    from dtrain.config import load_config

    assert OBJECTIVES["orpo"] is ORPO and set(OBJECTIVES) == {"orpo", "dpo", "simpo", "sft"}
    cfg = load_config(None, ["data.demo_pairs=4", "orpo.lambda=0.25", "orpo.nll_scope=response"])
    assert make_objective(cfg) == ORPO(0.25, "response")  # objective.kind's default
    assert make_objective(cfg, "orpo") == ORPO(0.25, "response")


def test_a_new_objective_gets_summed_logps_counts_and_per_pair_extras():
    """The toy objective's loss from the engine equals the same formula on log-probabilities
    summed by hand from the reference model's logits, with the per-pair ``ref`` inputs."""
    model = lora_model("llama")
    pairs = with_ref(make_pairs(), [0.5, -1.0, 2.0])
    toy = ToyMargin(0.3)
    out = ReferenceEngine(model, toy).evaluate(pairs, batch_totals(pairs, toy.nll_scope))

    def side_logps(prompt, response):
        tokens = mx.array([prompt + response])
        logp = nn.log_softmax(model(tokens)[0].astype(mx.float32), axis=-1)
        P = len(prompt)
        return sum(logp[P - 1 + i, t].item() for i, t in enumerate(response))

    margins = [side_logps(p.prompt, p.chosen) - side_logps(p.prompt, p.rejected) - p.extra["ref"] for p in pairs]
    expected = sum(np.logaddexp(0.0, -0.3 * m) for m in margins) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-4)
    assert out.sums["margin_sum"].item() == pytest.approx(sum(margins), rel=1e-4)


@pytest.mark.parametrize("variant", [dict(segment_layers=2), dict(segment_layers=0, prefix_sharing=True)])
def test_segmented_equals_reference_for_a_new_objective(variant):
    model = lora_model("llama")
    pairs = with_ref(make_pairs(), [0.5, -1.0, 2.0])
    toy = ToyMargin(0.3)
    ref = ReferenceEngine(model, toy).step(pairs, batch_totals(pairs, toy.nll_scope))
    out = engine_for(model, **variant)
    out = type(out)(model, out.arch, toy, **variant).step(pairs, batch_totals(pairs, toy.nll_scope))
    assert rel(out.loss, ref.loss) < 1e-5
    for (k, a), b in zip(sorted(ref.grads["model"]["layers"][0]["self_attn"]["q_proj"].items()),
                         [v for _, v in sorted(out.grads["model"]["layers"][0]["self_attn"]["q_proj"].items())]):
        if k.startswith("lora"):
            assert rel(b, a) < 1e-4, k


def test_pairs_must_carry_the_same_extra_inputs():
    pairs = make_pairs()
    pairs = [replace(pairs[0], extra={"ref": 1.0})] + pairs[1:]
    with pytest.raises(ValueError, match="different extra inputs"):
        ReferenceEngine(lora_model("llama"), ToyMargin(0.3)).layout(pairs)


@pytest.mark.parametrize("lam", [0.0, 0.1, 0.7])
def test_lambda_as_a_step_input_equals_lambda_in_the_objective(lam):
    model = lora_model("llama")
    pairs = make_pairs()
    for engine in (ReferenceEngine(model, ORPO(0.1)), engine_for(model, segment_layers=2),
                   engine_for(model, segment_layers=0)):
        given = engine.step(pairs, NORM, hyper=ORPO(lam).hyper())
        built = type(engine)(model, ORPO(lam)) if isinstance(engine, ReferenceEngine) else \
            type(engine)(model, engine.arch, ORPO(lam), segment_layers=engine.plan.size if engine.plan.size < 5 else 0)
        own = built.step(pairs, NORM)
        assert given.loss.item() == own.loss.item()


def test_a_new_lambda_does_not_retrace_the_compiled_step():
    model = lora_model("llama")
    calls = []

    class Counting(ORPO):
        def loss(self, logps, totals, hyper):
            calls.append(1)  # runs while tracing only
            return super().loss(logps, totals, hyper)

    engine = type(engine_for(model))(model, engine_for(model).arch, Counting(0.1), segment_layers=0, compile=True)
    pairs = make_pairs()
    first = engine.step(pairs, NORM, hyper=ORPO(0.1).hyper()).loss.item()
    traced = len(calls)
    second = engine.step(pairs, NORM, hyper=ORPO(0.9).hyper()).loss.item()
    assert traced > 0 and len(calls) == traced and first != second
    assert second == pytest.approx(engine_for(model, lam=0.9).step(pairs, NORM).loss.item(), rel=1e-5)


def test_the_segmented_engine_keeps_no_per_step_values():
    model = lora_model("llama")
    for kw in (dict(segment_layers=2), dict(segment_layers=0), dict(segment_layers="auto", head_chunk_tokens=4)):
        engine = engine_for(model, **kw)
        before = set(vars(engine))
        engine.step(make_pairs(), NORM)
        engine.evaluate(make_pairs(1), NORM)
        assert set(vars(engine)) == before, set(vars(engine)) ^ before


@pytest.mark.parametrize("n, batch, world, micro", [(10, 4, 1, 4), (10, 7, 3, 2), (5, 5, 2, 1), (9, 3, 4, 8)])
def test_sampler_take_is_the_global_batch_and_this_ranks_micro_batches(n, batch, world, micro):
    sampler, items = Sampler(n, batch, seed=3), [f"p{i}" for i in range(n)]
    for step in (1, 2, 7):
        for rank in range(world):
            got, chunks = sampler.take(step, items, rank, world, micro)
            assert got == [items[i] for _, i in sampler.global_batch(step)]
            assert chunks == shard_batches(got, rank, world, micro)
            assert [x for c in chunks for x in c] == got[rank::world] and all(0 < len(c) <= micro for c in chunks)


def test_run_micro_batches_sums_the_chunks_it_is_given():
    model = lora_model("llama")
    engine, pairs = ReferenceEngine(model, ORPO(0.1)), make_pairs()
    whole, _ = run_micro_batches(engine, [pairs], NORM, with_grads=False)
    parts, _ = run_micro_batches(engine, [pairs[:1], pairs[1:]], NORM, with_grads=False)
    assert whole["pairs"] == parts["pairs"] == 3 and parts["nll_sum"] == pytest.approx(whole["nll_sum"], rel=1e-6)
    empty, grads = run_micro_batches(engine, [], NORM, with_grads=True)
    assert grads is None and set(empty) == set(ORPO.metric_keys) and not any(empty.values())
