"""Packing: a micro-batch's sequences back to back in one row.

The packed layout must give the loss, metric sums and LoRA gradients of the
padded one (float64, so that only the layout could tell them apart) and of the
reference engine; every token must see exactly the context and positions it
sees unpacked; ``perf/padding_fraction`` must count what a hand count gives.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from dtrain.config import Config
from dtrain.engine import ORPO, make_engine, run_micro_batches
from dtrain.engine.layout import attention_mask, shared_attention_plan, shared_prefix_layout, two_sequence_layout
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
    gather, scatter = np.array(plan.gather), np.array(plan.scatter)
    # the row and slot each query reads its output from; causal inside the row (padding slots sit last)
    return lambda q: list(gather.reshape(-1)[scatter[q] // plan.length * plan.length:][: scatter[q] % plan.length + 1])


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
