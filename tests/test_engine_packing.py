"""Packing: a micro-batch's sequences back to back in one row.

The packed layout must give the loss, metric sums and LoRA gradients of the
padded one (float64, so that only the layout could tell them apart) and of the
reference engine; every token must see exactly the context and positions it
sees unpacked; ``perf/padding_fraction`` must count what a hand count gives.
"""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from dtrain.config import Config
from dtrain.engine import ORPO, make_engine, run_micro_batches
from dtrain.engine.arch import adapter_for
from dtrain.engine.attention import GROUP_SAVING, attention_mask, first_query, group_rows, shared_attention_plan
from dtrain.engine.layout import bucket_length, shared_prefix_layout, two_sequence_layout
from dtrain.engine.segmented import SegmentedEngine
from dtrain.run.step import padding_fraction

from test_engine_segmented import NORM, assert_parity, engine_for, lora_model, make_pairs, rel

LENGTHS = ((6, 4, 5), (3, 7, 2), (9, 2, 3))  # make_pairs' (prompt, chosen, rejected)


def test_hand_counted_layouts_and_padding_fraction():
    """Prefix sharing: sequences of 15, 12, 14 tokens (41 real). Padded: 3 rows of 15 = 45
    computed, 4 padding; packed: one row of 41, none; packed to buckets of 16: 48, 7 padding.
    Two sequences per pair: 10, 11, 10, 5, 11, 12 tokens (59), padded to 6 x 12 = 72."""
    pairs = make_pairs()
    padded, packed = shared_prefix_layout(pairs), shared_prefix_layout(pairs, pack=True)
    assert (padded.shape, padded.input_tokens, padded.computed_tokens) == ((3, 15), 41, 45)
    assert (packed.shape, packed.input_tokens, packed.computed_tokens) == ((1, 41), 41, 41)
    assert packed.starts == (0, 15, 27) and padded.starts == (0, 15, 30)
    assert shared_prefix_layout(pairs, bucket=16, pack=True).shape == (1, 48)
    two = two_sequence_layout(pairs)
    assert (two.shape, two.input_tokens, two.computed_tokens) == ((6, 12), 59, 72)
    assert two_sequence_layout(pairs, pack=True).shape == (1, 59)

    # the step's figure from an engine's summed counts: micro-batches [p0, p1] (L = 15) and [p2] (L = 14)
    model = lora_model("llama")
    sums, _ = run_micro_batches(engine_for(model, prefix_sharing=True), [pairs[:2], pairs[2:]], NORM, False)
    assert (sums["input_tokens"], sums["computed_tokens"]) == (41.0, 44.0)
    assert padding_fraction(sums) == 1 - 41 / 44
    sums, _ = run_micro_batches(engine_for(model, prefix_sharing=True, pack=True), [pairs[:2], pairs[2:]], NORM, False)
    assert (sums["input_tokens"], sums["computed_tokens"]) == (41.0, 41.0) and padding_fraction(sums) == 0.0
    assert padding_fraction({"input_tokens": 0.0, "computed_tokens": 0.0}) == 0.0  # a rank with no pairs


def random_pairs(rng: random.Random, n: int, fallback: bool):
    lengths = [(rng.randint(1, 9), rng.randint(1, 8), rng.randint(1, 8)) for _ in range(n)]
    return make_pairs(rng.randrange(1000), n, fallback, lengths)


VARIANTS = {"single": dict(segment_layers=0), "ranges": dict(segment_layers=2, head_chunk_tokens=5)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "minicpm", "gemma3", "llama_sliding"])
def test_packed_equals_padded_float64(arch, prefix, variant):
    """Loss, every metric sum but the computed-token count, and every LoRA gradient: equal to
    1e-12 in float64 (exact shapes and buckets of 16; with a fallback pair under prefix
    sharing). Sliding-window models (gemma3, llama_sliding) exercise the packed mask."""
    model = lora_model(arch)
    model.set_dtype(mx.float64)
    rng = random.Random(7)
    for seed, bucket in ((0, 0), (1, 16)):
        pairs = random_pairs(rng, 4, fallback=prefix and seed == 1)
        kw = dict(VARIANTS[variant], prefix_sharing=prefix, length_bucket=bucket)
        padded_engine, packed_engine = engine_for(model, **kw), engine_for(model, pack=True, **kw)
        assert packed_engine.layout(pairs).shape[0] == 1
        padded, packed = padded_engine.step(pairs, NORM), packed_engine.step(pairs, NORM)
        mx.eval(padded.loss, padded.grads, packed.loss, packed.grads)
        assert rel(packed.loss, padded.loss) < 1e-12
        for k, v in padded.sums.items():
            if k != "computed_tokens":
                assert abs(float(packed.sums[k]) - float(v)) <= 1e-12 * max(1.0, abs(float(v))), k
        for (k, a), (_, b) in zip(tree_flatten(padded.grads), tree_flatten(packed.grads)):
            assert rel(b, a) < 1e-12, (k, rel(b, a))
        ev_padded, ev_packed = padded_engine.evaluate(pairs, NORM), packed_engine.evaluate(pairs, NORM)
        assert rel(ev_packed.loss, ev_padded.loss) < 1e-12


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_packed_matches_the_reference_engine(arch):
    """Against the reference engine (two padded sequences per pair, mlx-lm's own call), float32."""
    model = lora_model(arch)
    for kw in (dict(segment_layers=0, prefix_sharing=True), dict(segment_layers=2, head_chunk_tokens=7),
               dict(segment_layers=3, prefix_sharing=True, length_bucket=16)):
        assert_parity(model, engine_for(model, pack=True, **kw), make_pairs(fallback=True))


def _contexts(layout, keys_of):
    """Per real query token: (its sequence, its index, its token, position) -> sorted keys it attends,
    as (sequence, index, token, position) — what the model computes for it, wherever it is laid out."""
    flat = {n: np.array(getattr(layout, n)).reshape(-1) for n in ("tokens", "positions")}
    where = {}
    for i, (o, (P, C, R)) in enumerate(zip(layout.starts, layout.spans)):
        for t in range(P + C + R):
            where[o + t] = (i, t, int(flat["tokens"][o + t]), int(flat["positions"][o + t]))
    return {where[q]: sorted(where[k] for k in keys_of(q)) for q in where}


def _mask_keys(layout, window):
    m = np.array(attention_mask(layout, window))[:, 0]  # (S, L, L)
    L = layout.shape[1]
    return lambda q: [q // L * L + k for k in np.flatnonzero(m[q // L, q % L])]


def _plan_keys(layout):
    plan = shared_attention_plan(layout)
    scatter = np.array(plan.scatter)
    slots = []  # per computed output slot of the groups laid end to end: the keys its query sees
    for gather, q0 in zip(plan.gathers, plan.starts):  # queries [q0, M) of each row, causal in it
        slots += [[int(t) for t in row[: i + 1]] for row in np.array(gather) for i in range(q0, len(row))]
    return lambda q: slots[scatter[q]]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 5), st.booleans(), st.sampled_from([0, 8]), st.sampled_from([None, 3]))
def test_every_token_sees_the_context_it_sees_unpacked(seed, n, prefix, bucket, window):
    """Generated batches: each real query attends to the same (sequence, index, token, position)
    keys packed as padded, under the mask (any window) and under the gathered rows."""
    rng = random.Random(seed)
    pairs = random_pairs(rng, n, fallback=prefix and n > 1 and rng.random() < 0.5)
    build = shared_prefix_layout if prefix else two_sequence_layout
    padded, packed = build(pairs, bucket=bucket), build(pairs, bucket=bucket, pack=True)
    assert packed.spans == padded.spans and packed.input_tokens == padded.input_tokens
    assert packed.computed_tokens <= padded.computed_tokens or bucket  # exact shapes: never more tokens
    for name in ("targets", "pair_of", "w_nll", "w_chosen", "w_rejected"):
        assert np.array_equal(np.array(getattr(packed, name)), np.array(getattr(padded, name))), name
    # each target is predicted from the same sequence and index
    index = lambda lay: {o + t: (i, t) for i, (o, s) in enumerate(zip(lay.starts, lay.spans)) for t in range(sum(s))}  # noqa: E731
    real = np.array(padded.w_nll) + np.array(padded.w_chosen) + np.array(padded.w_rejected) > 0
    assert [index(packed)[r] for r in np.array(packed.rows)[real]] == [index(padded)[r] for r in np.array(padded.rows)[real]]
    assert _contexts(packed, _mask_keys(packed, window)) == _contexts(padded, _mask_keys(padded, window))
    assert _contexts(packed, _plan_keys(packed)) == _contexts(padded, _mask_keys(padded, None))


def test_make_engine_packs_by_default_and_not_with_sliding_windows():
    cfg = Config()
    assert cfg.engine.pack is True
    notes = []
    assert make_engine(cfg.engine, lora_model("llama"), ORPO(0.1), notes.append).pack is True and notes == []
    # the key's help says it is off there: no notice on every run of such a model
    assert make_engine(cfg.engine, lora_model("llama_sliding"), ORPO(0.1), notes.append).pack is False and notes == []
    cfg.engine.pack = False
    assert make_engine(cfg.engine, lora_model("llama"), ORPO(0.1)).pack is False


def test_attention_rows_grouped_by_length_hand_counted():
    """Rows of 100, 90, 20, 10 tokens: one call pads all four to 100 (40,000 slots of work);
    [100, 90] and [20, 10] cost 2*100² + 2*20² = 20,800; a third group ([20] and [10] apart)
    saves only 300 more (1.4%), under GROUP_SAVING, so two calls. Buckets of 16 round the
    lengths to 112, 96, 32, 16: one call 4*112² = 50,176; [112, 96] + [32, 32] (row counts of
    several calls are powers of two) 2*112² + 2*32² = 27,136, three calls 112² + 96² + 2*32² =
    23,808 (23,808 / 0.9² = 29,393 < 27,136 / 0.9 = 30,151), a fourth 23,040 (/ 0.9³ = 31,605):
    three. One call keeps the exact row count: three rows of 7 (8) are 3 x 8 (192 slots), not
    1 x 8 + 2 x 8 (also 192: the second call saves nothing). Rows 381, 365, 362, 312, 306, 27,
    4 with buckets of 128 (384 x 5, 128 x 2): one call 7*384² = 1,032,192; three calls (384 |
    384 x 4 | 128 x 2) 770,048, which / 0.9² = 950,676 is less: three (two calls round 5 rows to
    8 and save nothing)."""
    assert group_rows([20, 100, 10, 90], 0) == [([1, 3], 2, 100, 0), ([0, 2], 2, 20, 0)]
    assert group_rows([20, 100, 10, 90], 16) == [([1], 1, 112, 0), ([3], 1, 96, 0), ([0, 2], 2, 32, 0)]
    assert group_rows([7, 7, 7], 0) == [([0, 1, 2], 3, 7, 0)]
    assert group_rows([7, 7, 7], 4) == [([0, 1, 2], 3, 8, 0)]
    assert group_rows([312, 362, 306, 381, 27, 4, 365], 128) == [([3], 1, 384, 0), ([6, 1, 0, 2], 4, 384, 0),
                                                                  ([4, 5], 2, 128, 0)]
    assert group_rows([], 0) == [] and group_rows([0, 0, 0], 0) == [([0, 1, 2], 3, 0, 0)]
    with pytest.raises(ValueError, match="attention groups must be >= 1"):
        group_rows([5], 0, 0)
    assert group_rows([5], 0) == [([0], 1, 5, 0)]


def test_rows_that_need_later_queries_hand_counted():
    """Rows of 100 and 90 tokens whose queries are needed from 0 and from 60 (a [prompt; rejected]
    row under a 60-token prompt): one call computes 2 * 100² = 20,000 scores' worth; apart,
    100² + (90² - 60²) = 14,500 (/ 0.9 = 16,111 < 20,000): two calls, the second from slot 60.
    With buckets of 16 (112 and 96; start 60 rounds down to 48): one call 2 * 112² = 25,088,
    apart 112² + 96² - 48² = 19,456 (/ 0.9 = 21,618): two calls, the second from slot 48. A row
    needed from its start keeps one call for rows of equal length (7, 7 from 3: 2 * 49 = 98
    against 49 + 40 = 89, / 0.9 = 98.9)."""
    assert group_rows([100, 90], 0, starts=[0, 60]) == [([0], 1, 100, 0), ([1], 1, 90, 60)]
    assert first_query([0, 60], [1], 0) == 60 and first_query([0, 60], [0, 1], 0) == 0
    assert group_rows([100, 90], 16, starts=[0, 60]) == [([0], 1, 112, 0), ([1], 1, 96, 48)]
    assert first_query([0, 60], [1], 16) == 48
    assert group_rows([100, 90], 0, starts=np.array([0, 60])) == [([0], 1, 100, 0), ([1], 1, 90, 60)]  # any sequence
    assert group_rows([7, 7], 0, starts=[0, 3]) == [([0, 1], 2, 7, 0)]
    assert group_rows([100, 90], 0) == [([0, 1], 2, 100, 0)]  # without starts the rows stay together


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=14), st.sampled_from([0, 8, 128]),
       st.integers(1, 5), st.randoms(use_true_random=False), st.booleans())
def test_attention_groups_cover_every_row_once_and_never_cost_more(lengths, bucket, max_groups, rnd, later):
    """Generated row lengths (and, half the time, the first query each row needs): every row in
    exactly one group, each group as long as its longest row's bucket and at least as wide as its
    rows (exact for one call and without buckets, else a power of two), at most ``max_groups``
    groups, longest first; one call is every row padded to the longest; and no other number of
    calls (each at its least work ``rows * (M² - start²)``, found by brute force over the cuts)
    has a lower work / 0.9^(calls - 1)."""
    starts = [rnd.randrange(n) if rnd.random() < 0.5 else 0 for n in lengths] if later else None
    groups = group_rows(lengths, bucket, max_groups, starts)
    q0 = lambda rows: min(starts[i] for i in rows) // max(bucket, 1) * max(bucket, 1) if starts else 0  # noqa: E731
    assert sorted(i for members, *_ in groups for i in members) == list(range(len(lengths)))
    assert 1 <= len(groups) <= max_groups
    for members, width, M, start in groups:
        assert M == max(bucket_length(lengths[i], bucket) for i in members)
        exact = bucket == 0 or len(groups) == 1
        assert width == len(members) if exact else width >= len(members) and width & (width - 1) == 0
        assert start == first_query(starts, members, bucket) == q0(members) and 0 <= start < M
    assert [M for _, _, M, _ in groups] == sorted((M for _, _, M, _ in groups), reverse=True)
    n, longest = len(lengths), bucket_length(max(lengths), bucket)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    assert group_rows(lengths, bucket, 1, starts) == [(order, n, longest, q0(order))]
    if n <= 10:  # brute force: every cut of the sorted rows into k runs
        from itertools import combinations

        M = sorted((bucket_length(x, bucket) for x in lengths), reverse=True)
        width = (lambda k: k) if bucket == 0 else (lambda k: 1 << (k - 1).bit_length())
        least = {1: n * (M[0] ** 2 - q0(order) ** 2)}
        for k in range(2, min(max_groups, n) + 1):
            least[k] = min(sum(width(b - a) * (M[a] ** 2 - q0(order[a:b]) ** 2) for a, b in zip((0, *cuts), (*cuts, n)))
                           for cuts in combinations(range(1, n), k - 1))
        score = {k: w / (1 - GROUP_SAVING) ** (k - 1) for k, w in least.items()}
        assert sum(width * (M**2 - start**2) for _, width, M, start in groups) == least[len(groups)]
        assert score[len(groups)] <= min(score.values()) * (1 + 1e-12)


def assert_same_step(one, other, pairs, tol=1e-12):
    """Two engines' steps on ``pairs``: the same loss, metric sums and LoRA gradients to ``tol``."""
    a, b = one.step(pairs, NORM), other.step(pairs, NORM)
    mx.eval(a.loss, a.grads, b.loss, b.grads)
    assert abs(float(b.loss) - float(a.loss)) <= tol * max(1.0, abs(float(a.loss)))
    for k, v in a.sums.items():
        assert abs(float(b.sums[k]) - float(v)) <= tol * max(1.0, abs(float(v))), k
    for (k, x), (_, y) in zip(tree_flatten(a.grads), tree_flatten(b.grads)):
        assert rel(y, x) < tol, (k, rel(y, x))


@pytest.mark.parametrize("kernels", ["mlx", "dtrain"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_grouped_attention_equals_one_call_float64(arch, variant, kernels):
    """Pairs of very different lengths (rows of 4 to 31 tokens, so the rows split into several
    calls): loss, metric sums and every LoRA gradient with ``attention_groups`` 4 equal those of
    one call padding every row to the longest, to 1e-12 in float64, packed and padded, exact
    shapes and buckets of 8 (MLX's attention and dtrain's own)."""
    model = lora_model(arch)
    model.set_dtype(mx.float64)
    pairs = make_pairs(3, 4, lengths=((2, 1, 2), (12, 16, 3), (3, 2, 2), (5, 3, 20)))
    for pack, bucket in ((False, 0), (True, 0), (True, 8)):
        kw = dict(VARIANTS[variant], prefix_sharing=True, pack=pack, length_bucket=bucket)
        one = engine_for(model, own_kernels=kernels == "dtrain", attention_groups=1, **kw)
        grouped = engine_for(model, own_kernels=kernels == "dtrain", attention_groups=4, **kw)
        assert len(shared_attention_plan(grouped.layout(pairs), 4).shapes) > 1  # the rows did split
        assert_same_step(one, grouped, pairs)


@pytest.mark.parametrize("kernels", ["mlx", "dtrain"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_rejected_rows_without_prompt_queries_train_as_before_float64(arch, kernels):
    """Long prompts (a [prompt; rejected] row computed from its first rejected query on, one call
    per row): loss, metric sums and every LoRA gradient equal one call over whole rows to 1e-12 in
    float64, packed and padded, exact shapes and buckets of 8, and the reference engine's
    (mlx-lm's forward) to its usual bounds."""
    model = lora_model(arch)
    model.set_dtype(mx.float64)
    pairs = make_pairs(3, 2, lengths=((20, 3, 18), (17, 2, 15)))
    for pack, bucket in ((False, 0), (True, 0), (True, 8)):
        kw = dict(prefix_sharing=True, pack=pack, length_bucket=bucket)
        one = engine_for(model, own_kernels=kernels == "dtrain", attention_groups=1, **kw)
        grouped = engine_for(model, own_kernels=kernels == "dtrain", attention_groups=4, **kw)
        plan = shared_attention_plan(grouped.layout(pairs), 4)
        assert max(plan.starts) >= 16 and shared_attention_plan(one.layout(pairs), 1).starts == (0,)
        assert_same_step(one, grouped, pairs)
        assert_parity(model, grouped, pairs)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 6), st.integers(2, 5), st.booleans(), st.sampled_from([0, 8]),
       st.sampled_from(["orpo", "dpo", "sft"]))
def test_generated_batches_train_the_same_in_any_number_of_calls(seed, n, groups, pack, bucket, objective):
    """Generated batches (random lengths, a fallback pair, SFT rows with no rejected side, DPO's
    reference inputs): ``attention_groups`` 2-5 gives one call's loss, sums and gradients to 1e-11
    in float64."""
    from dtrain.engine import DPO, SFT

    rng = random.Random(seed)
    lengths = [(rng.randint(1, 12), rng.randint(1, 14), rng.randint(1, 14)) for _ in range(n)]
    pairs = make_pairs(rng.randrange(1000), n, fallback=n > 1 and rng.random() < 0.5, lengths=lengths)
    if objective == "sft":
        pairs = [dataclasses.replace(p, rejected=[], rejected_prompt=None) if rng.random() < 0.6 else p for p in pairs]
        obj = SFT()
    elif objective == "dpo":
        pairs = [dataclasses.replace(p, extra={"ref_chosen": -rng.uniform(5, 30), "ref_rejected": -rng.uniform(5, 30)})
                 for p in pairs]
        obj = DPO(0.1)
    else:
        obj = ORPO(0.1)
    model = lora_model("llama", seed=seed % 3)
    model.set_dtype(mx.float64)
    kw = dict(segment_layers=0, prefix_sharing=True, pack=pack, length_bucket=bucket)
    one = SegmentedEngine(model, adapter_for(model), obj, attention_groups=1, **kw)
    many = SegmentedEngine(model, adapter_for(model), obj, attention_groups=groups, **kw)
    assert_same_step(one, many, pairs, 1e-11)


def test_attention_groups_below_one_are_refused_when_the_engine_is_built():
    model = lora_model("llama")
    with pytest.raises(ValueError, match="attention_groups must be >= 1, got 0"):
        engine_for(model, prefix_sharing=True, attention_groups=0)
