"""Every objective through the engines: LoRA gradients against finite differences,
segmented = reference, prefix sharing = two sequences, with DPO's reference
log-probabilities carried per pair."""

import dataclasses
import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten, tree_map

from dtrain.engine import ReferenceEngine, batch_totals
from dtrain.engine.arch import adapter_for
from dtrain.engine.segmented import SegmentedEngine
from dtrain.engine import DPO, ORPO, SFT, SimPO
from dtrain.types import TokenizedPair

from conftest import add_random_lora, make_tiny_model

from test_engine_reference import PAIRS, central_difference, lora_model as fd_model
from test_engine_segmented import lora_model, make_pairs, rel

OBJECTIVES = {
    "dpo_sigmoid": DPO(0.1, "sigmoid"), "dpo_ipo": DPO(0.5, "ipo"), "dpo_hinge": DPO(0.1, "hinge"),
    "simpo": SimPO(2.0, 0.5), "simpo_nll": SimPO(2.0, 0.5, 0.5), "sft": SFT("response"), "sft_full": SFT("full"),
}


def with_ref(pairs, seed=0):
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(p, extra={"ref_chosen": float(rng.uniform(-60, -5)),
                                          "ref_rejected": float(rng.uniform(-60, -5))})
            for p in pairs]


def assert_directional_derivatives(model, obj, pairs, seed=7, n=2):
    """LoRA gradients of ``obj`` on ``pairs`` (reference engine) against central finite
    differences along ``n`` random directions (float64 model)."""
    engine = ReferenceEngine(model, obj)
    norm = batch_totals(pairs, obj.nll_scope)
    grads = engine.step(pairs, norm).grads
    params = model.trainable_parameters()
    mx.random.seed(seed)
    for _ in range(n):
        direction = tree_map(lambda p: mx.random.normal(p.shape).astype(mx.float64), params)

        def along(eps):
            model.update(tree_map(lambda p, d: p + eps * d, params, direction))
            return engine.evaluate(pairs, norm).loss.item()

        fd = central_difference(along, 4e-3)
        model.update(params)
        analytic = sum((g * d).sum().item() for (_, g), (_, d) in zip(tree_flatten(grads), tree_flatten(direction)))
        assert abs(fd) > 1e-4  # a non-trivial derivative
        assert analytic == pytest.approx(fd, rel=2e-4)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_lora_gradients_match_central_finite_differences(name):
    assert_directional_derivatives(fd_model(mx.float64), OBJECTIVES[name], with_ref(PAIRS))


@pytest.mark.parametrize("built, given", [(DPO(0.1), DPO(0.4)), (DPO(0.1, "ipo"), DPO(0.4, "ipo")),
                                          (SimPO(2.0, 0.5, 0.0), SimPO(2.5, 1.0, 0.7))], ids=["dpo", "ipo", "simpo"])
def test_hyper_parameters_are_step_inputs_of_the_compiled_engine(built, given):
    """beta (and SimPO's gamma, nll_weight) given as step inputs = an objective built with them,
    through the compiled single pass, without tracing it again."""
    calls = []

    class Counting(type(built)):
        def loss(self, logps, totals, hyper):
            calls.append(1)  # runs while tracing only
            return super().loss(logps, totals, hyper)

    model, pairs = lora_model("llama"), with_ref(make_pairs())
    arch = adapter_for(model)
    engine = SegmentedEngine(model, arch, Counting(*dataclasses.astuple(built)), segment_layers=0, compile=True)
    norm = batch_totals(pairs, built.nll_scope)
    first = engine.step(pairs, norm).loss.item()
    traced = len(calls)
    second = engine.step(pairs, norm, hyper=given.hyper()).loss.item()
    assert traced > 0 and len(calls) == traced and first != second
    own = SegmentedEngine(model, arch, given, segment_layers=0, compile=True).step(pairs, norm).loss.item()
    assert second == pytest.approx(own, rel=1e-6)


# segmented-engine settings every objective is checked under (pack: the sequences of a micro-batch in one row)
VARIANTS = [dict(segment_layers=2), dict(segment_layers=2, prefix_sharing=True),
            dict(segment_layers=3, prefix_sharing=True, head_chunk_tokens=7), dict(segment_layers=0, prefix_sharing=True),
            dict(segment_layers=2, pack=True), dict(segment_layers=0, prefix_sharing=True, pack=True, length_bucket=16)]
VARIANT_IDS = ["segmented", "prefix", "prefix_chunked", "one_range", "packed", "prefix_packed_bucket"]


def parity(model, engine, pairs, obj):
    norm = batch_totals(pairs, obj.nll_scope)
    ref = ReferenceEngine(model, obj).step(pairs, norm)
    out = engine.step(pairs, norm)
    mx.eval(ref.loss, ref.grads, out.loss, out.grads)
    assert rel(out.loss, ref.loss) < 1e-5, (float(out.loss), float(ref.loss))
    for k, v in ref.sums.items():
        if k not in ("input_tokens", "fallback_pairs", "computed_tokens"):  # layout counts differ by design
            assert abs(float(out.sums[k]) - float(v)) <= 1e-5 * max(1.0, abs(float(v))), (k, out.sums[k], v)
    g_ref, g_out = dict(tree_flatten(ref.grads)), dict(tree_flatten(out.grads))
    assert g_ref.keys() == g_out.keys()
    for k in g_ref:
        assert rel(g_out[k], g_ref[k]) < 1e-4, (k, rel(g_out[k], g_ref[k]))
    ev_ref, ev = ReferenceEngine(model, obj).evaluate(pairs, norm), engine.evaluate(pairs, norm)
    assert rel(ev.loss, ev_ref.loss) < 1e-5
    return out


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("name", OBJECTIVES)
def test_segmented_equals_reference(name, variant):
    """Segmented (ranges, chunked head, single pass) = reference; with prefix sharing this is
    also prefix sharing = two sequences (the reference engine runs two sequences per pair)."""
    obj = OBJECTIVES[name]
    model = lora_model("llama")
    pairs = with_ref(make_pairs(fallback=True))
    parity(model, SegmentedEngine(model, adapter_for(model), obj, **variant), pairs, obj)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_prefix_sharing_equals_two_sequences_in_the_segmented_engine(name):
    obj = OBJECTIVES[name]
    model = lora_model("qwen3")
    pairs = with_ref(make_pairs())
    norm = batch_totals(pairs, obj.nll_scope)
    two = SegmentedEngine(model, adapter_for(model), obj, segment_layers=2).step(pairs, norm)
    one = SegmentedEngine(model, adapter_for(model), obj, segment_layers=2, prefix_sharing=True).step(pairs, norm)
    assert rel(one.loss, two.loss) < 1e-5
    for (k, a), (_, b) in zip(tree_flatten(one.grads), tree_flatten(two.grads)):
        assert rel(a, b) < 1e-4, k


def test_orpo_is_unchanged_by_reference_log_probs():
    """Reference values on the pairs are read by DPO only."""
    model = lora_model("llama")
    pairs = make_pairs()
    a = ReferenceEngine(model, ORPO(0.1)).evaluate(pairs, batch_totals(pairs, "full"))
    b = ReferenceEngine(model, ORPO(0.1)).evaluate(with_ref(pairs), batch_totals(pairs, "full"))
    assert a.loss.item() == b.loss.item()


def test_reference_pass_objective_returns_summed_log_probs_of_each_pair():
    """ReferenceLogps through an engine = sums of log-probs computed from mlx-lm's logits directly."""
    from dtrain.run.reference import ReferenceLogps

    model = lora_model("llama")
    pairs = make_pairs()
    out = ReferenceEngine(model, ReferenceLogps()).evaluate(pairs, batch_totals(pairs, "response"))
    for i, p in enumerate(pairs):
        for side, key in ((p.chosen, "ref_chosen"), (p.rejected, "ref_rejected")):
            seq = mx.array([p.prompt + side])
            logits = model(seq)[0].astype(mx.float32)  # (L, V)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            P = len(p.prompt)
            want = sum(logp[P - 1 + j, t].item() for j, t in enumerate(side))
            assert out.sums[key][i].item() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", ["dpo_sigmoid", "dpo_ipo", "simpo"])
def test_a_pair_without_preference_signal_gives_no_gradient(name):
    """chosen == rejected: the log-ratio difference is 0 whatever the weights, so the pairwise
    objectives get no gradient from it; the data layer drops such pairs before any objective
    ("same ids", dtrain.data.render; tests/test_data_render.py)."""
    obj = OBJECTIVES[name]
    model = lora_model("llama")
    p = make_pairs()[0]
    same = dataclasses.replace(p, rejected=p.chosen, extra={"ref_chosen": -20.0, "ref_rejected": -20.0})
    g_same = engine_grads(model, obj, [same])
    g_real = engine_grads(model, obj, with_ref([p]))
    norm = lambda g: float(np.sqrt(sum((np.array(v, np.float64) ** 2).sum() for _, v in tree_flatten(g))))  # noqa: E731
    assert norm(g_real) > 1e-3
    assert norm(g_same) <= 1e-6 * norm(g_real)


def engine_grads(model, obj, pairs):
    return ReferenceEngine(model, obj).step(pairs, batch_totals(pairs, obj.nll_scope)).grads


def sft_rows(seed=0):
    """Rows with one completion (empty rejected), beside preference pairs, as SFT runs them."""
    pairs = make_pairs(seed=seed, fallback=True)
    return [dataclasses.replace(p, rejected=[], rejected_prompt=None) for p in pairs[:2]] + pairs[2:]


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("name", ["sft", "sft_full"])
def test_sft_rows_segmented_equals_reference(name, variant):
    obj = OBJECTIVES[name]
    model = lora_model("llama")
    parity(model, SegmentedEngine(model, adapter_for(model), obj, **variant), sft_rows(), obj)


def test_sft_row_is_its_chosen_sequence_alone_and_equals_the_pair_it_came_from():
    """An SFT row trains the same NLL as the preference pair's chosen side; its layout has no rejected row."""
    from dtrain.engine.layout import shared_prefix_layout, two_sequence_layout

    model = lora_model("llama")
    pairs = make_pairs()
    rows = [dataclasses.replace(p, rejected=[]) for p in pairs]
    assert two_sequence_layout(rows).shape[0] == 3 and shared_prefix_layout(rows).shape[0] == 3
    assert float(two_sequence_layout(rows).w_rejected.sum()) == 0.0
    packed = two_sequence_layout(rows, pack=True)  # one row: the three chosen sequences back to back
    assert packed.shape == (1, sum(len(p.prompt) + len(p.chosen) for p in rows)) and len(packed.spans) == 3
    assert float(packed.w_rejected.sum()) == 0.0 and shared_prefix_layout(rows, pack=True).shape == packed.shape
    obj = SFT()
    a = ReferenceEngine(model, obj).step(pairs, batch_totals(pairs, obj.nll_scope))
    b = ReferenceEngine(model, obj).step(rows, batch_totals(rows, obj.nll_scope))
    assert rel(b.loss, a.loss) < 1e-6
    for (k, x), (_, y) in zip(tree_flatten(a.grads), tree_flatten(b.grads)):
        assert rel(y, x) < 1e-5, k


def test_sft_gradients_match_finite_differences_on_sft_rows():
    rows = [dataclasses.replace(p, rejected=[]) for p in PAIRS]
    assert_directional_derivatives(fd_model(mx.float64), SFT(), rows, seed=3, n=1)


# -- generated batches against a hand computation -------------------------------------------

def generated_case(seed: int):
    """An objective, segmented-engine settings, a micro-batch split and a batch of 1-6 pairs drawn
    from ``seed``: 1-token prompts and sides, responses up to 14x the prompt, one prompt shared by
    every pair, chosen == rejected, a fallback pair (``rejected_prompt``), SFT rows under SFT; DPO's
    reference log-probs are float32 values, as ``layout.pair_extras`` carries them."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(1, 64) for _ in range(k)]  # noqa: E731
    obj = rng.choice([ORPO(rng.choice([0.0, 0.1, 1.0]), rng.choice(["full", "response"])), DPO(0.1, "sigmoid"),
                      DPO(0.5, "ipo"), DPO(0.5, "hinge"), SimPO(2.0, rng.choice([0.0, 0.5]), rng.choice([0.0, 0.5])),
                      SFT(rng.choice(["full", "response"]))])
    shared = ids(rng.randint(1, 6)) if rng.random() < 0.3 else None
    pairs = []
    for i in range(rng.randint(1, 6)):
        chosen = ids(rng.choice([1, rng.randint(1, 14)]))
        rejected = list(chosen) if rng.random() < 0.2 else ids(rng.choice([1, rng.randint(1, 14)]))
        rp = ids(rng.randint(1, 7)) if rng.random() < 0.15 else None
        if isinstance(obj, SFT) and rng.random() < 0.5:
            rejected, rp = [], None
        extra = {k: float(np.float32(-rng.uniform(1, 40))) for k in ("ref_chosen", "ref_rejected")}
        pairs.append(TokenizedPair(list(shared) if shared else ids(rng.choice([1, rng.randint(1, 9)])), chosen,
                                   rejected, f"g:{i}", rejected_prompt=rp, extra=extra))
    # a 1 kB budget: "auto" recomputes ranges with a chunked head, never the single pass
    kw = dict(segment_layers=rng.choice([0, 1, "auto"]), memory_budget=1e3, prefix_sharing=rng.random() < 0.6,
              head_chunk_tokens=rng.choice([0, 1, 3, 7]), length_bucket=rng.choice([0, 4, 8]),
              pack=rng.random() < 0.4, attention_groups=rng.randint(1, 4))
    return obj, pairs, kw, rng.random() < 0.5, rng.randint(1, len(pairs))


def hand_metrics(model, pairs, obj) -> dict:
    """``obj.finalize``'s values for one global batch, in numpy float64 from mlx-lm's logits of
    each ``[prompt; response]`` run alone (module docs of loss.py, dpo.py, simpo.py, sft.py)."""

    def side(prompt, response):  # (prompt targets' log-probs, response's)
        logits = np.array(model(mx.array([prompt + response]))[0], np.float64)  # (L, V)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        P = len(prompt)
        return (np.array([logp[t, prompt[t + 1]] for t in range(P - 1)]),
                np.array([logp[P - 1 + t, x] for t, x in enumerate(response)]))

    nll, nll_tokens, rows = 0.0, 0, []
    for p in pairs:
        prompt_lp, c = side(p.prompt, p.chosen)
        full = obj.nll_scope == "full"
        nll -= c.sum() + (prompt_lp.sum() if full else 0.0)
        nll_tokens += len(p.chosen) + (len(p.prompt) - 1 if full else 0)
        r = side(p.rejected_prompt or p.prompt, p.rejected)[1] if p.rejected else np.zeros(0)
        rows.append((c.sum(), len(c), r.sum(), max(len(r), 1), p.extra))
    nll /= nll_tokens
    lw = np.array([c / C for c, C, *_ in rows])
    lr = np.array([r / R for _, _, r, R, _ in rows])
    softplus = lambda x: np.logaddexp(0.0, x)  # noqa: E731
    if isinstance(obj, SFT):
        return {"loss": nll, "nll_loss": nll, "logps/chosen": lw.mean()}
    if isinstance(obj, ORPO):  # ORPO eq. 4-7
        log1mexp = lambda x: np.log(-np.expm1(np.minimum(x, -1e-7)))  # noqa: E731
        lo = (lw - lr) - (log1mexp(lw) - log1mexp(lr))
        return {"loss": nll + obj.lam * softplus(-lo).mean(), "nll_loss": nll, "log_odds_ratio": -softplus(-lo).mean(),
                "log_odds_chosen": lo.mean(), "rewards/chosen": obj.lam * lw.mean(),
                "rewards/rejected": obj.lam * lr.mean(), "rewards/accuracies": (lw > lr).mean(),
                "rewards/margins": obj.lam * (lw - lr).mean(), "logps/chosen": lw.mean(), "logps/rejected": lr.mean()}
    if isinstance(obj, SimPO):
        per = softplus(-(obj.beta * (lw - lr) - obj.gamma))
        return {"loss": obj.nll_weight * nll + per.mean(), "nll_loss": nll, "simpo_loss": per.mean(),
                "rewards/chosen": obj.beta * lw.mean(), "rewards/rejected": obj.beta * lr.mean(),
                "rewards/accuracies": (lw > lr).mean(), "rewards/margins": obj.beta * (lw - lr).mean(),
                "logps/chosen": lw.mean(), "logps/rejected": lr.mean()}
    pc, pr = np.array([c for c, *_ in rows]), np.array([r for _, _, r, _, _ in rows])
    rc, rr = (np.array([e[k] for *_, e in rows]) for k in ("ref_chosen", "ref_rejected"))
    if obj.loss_type == "ipo":  # means per token, policy and reference
        C, R = np.array([x[1] for x in rows]), np.array([x[3] for x in rows])
        pc, pr, rc, rr = pc / C, pr / R, rc / C, rr / R
    h, b = (pc - rc) - (pr - rr), obj.beta
    losses = {"sigmoid": softplus(-b * h), "ipo": (h - 1 / (2 * b)) ** 2, "hinge": np.maximum(0.0, 1 - b * h)}
    return {"loss": losses[obj.loss_type].mean(), "rewards/chosen": b * (pc - rc).mean(),
            "rewards/rejected": b * (pr - rr).mean(), "rewards/accuracies": (pc - rc > pr - rr).mean(),
            "rewards/margins": b * h.mean(), "logps/chosen": pc.mean(), "logps/rejected": pr.mean()}


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**6))
def test_generated_batches_every_objective_equals_a_hand_computation(seed):
    """Generated edge-case batches (``generated_case``), every objective, in float64: the segmented
    engine (random ranges, chunks, buckets, packing, attention calls, kernels), summed over a random
    micro-batch split with global totals, gives the reference engine's metric sums and LoRA
    gradients, both give ``hand_metrics``, and the gradient matches central differences."""
    from dtrain.engine import run_micro_batches
    from dtrain.sampler import micro_batches

    obj, pairs, kw, own_kernels, micro = generated_case(seed)
    model = add_random_lora(make_tiny_model(seed=seed % 3, hidden_size=16, num_hidden_layers=2,
                                            intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                            vocab_size=64), seed % 3, rank=2)
    model.set_dtype(mx.float64)
    totals = batch_totals(pairs, obj.nll_scope)
    seg = SegmentedEngine(model, adapter_for(model, own_kernels), obj, **kw)
    ref_sums, ref_grads = run_micro_batches(ReferenceEngine(model, obj), [pairs], totals, True)
    sums, grads = run_micro_batches(seg, micro_batches(pairs, micro), totals, True)
    evaluated, _ = run_micro_batches(seg, micro_batches(pairs, len(pairs) + 1 - micro), totals, False)
    for k in obj.metric_keys:
        if k not in ("input_tokens", "fallback_pairs", "computed_tokens"):  # layout counts differ by design
            assert sums[k] == pytest.approx(ref_sums[k], rel=1e-6, abs=1e-5), k
            assert evaluated[k] == pytest.approx(ref_sums[k], rel=1e-6, abs=1e-5), k
    want = hand_metrics(model, pairs, obj)
    for got in (obj.finalize(ref_sums), obj.finalize(sums)):
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-5), k
    flat = lambda g: np.concatenate([np.array(v, np.float64).ravel() for _, v in tree_flatten(g)])  # noqa: E731
    g, g_ref = flat(grads), flat(ref_grads)
    scale = np.linalg.norm(g_ref)
    assert np.linalg.norm(g - g_ref) <= 1e-5 * scale + 1e-9
    if scale < 1e-6 or getattr(obj, "loss_type", "") == "hinge":  # no gradient, or a kink within reach
        return
    params = model.trainable_parameters()
    mx.random.seed(seed)
    direction = tree_map(lambda p: mx.random.normal(p.shape).astype(mx.float64), params)

    def along(eps):
        model.update(tree_map(lambda p, d: p + eps * d, params, direction))
        return run_micro_batches(seg, [pairs], totals, False)[0]

    d = lambda h: (obj.finalize(along(h))["loss"] - obj.finalize(along(-h))["loss"]) / (2 * h)  # noqa: E731
    fd = (4 * d(2e-3) - d(4e-3)) / 3  # Richardson: cancels the O(h^2) term
    model.update(params)
    assert float(g @ flat(direction)) == pytest.approx(fd, rel=1e-3, abs=1e-3 * scale)  # g.d ~ N(0, scale**2)
