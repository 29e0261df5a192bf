"""Segmented engine = reference engine: loss, metric sums and LoRA gradients.

Every supported architecture runs on a tiny random model with LoRA on every
decoder layer (lora_b randomised, since mlx-lm initialises it to zero), under
three engine variants: segmented; + prefix sharing; + chunked LM head.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dtrain.config import Config
from dtrain.engine import ReferenceEngine, Totals, batch_totals, make_engine
from dtrain.engine.arch import adapter_for
from dtrain.engine.segmented import SegmentedEngine
from dtrain.engine import ORPO
from dtrain.types import TokenizedPair

from conftest import add_random_lora, make_tiny_model

VOCAB = 512
SMALL = dict(hidden_size=32, num_hidden_layers=5, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB)
ARCHS = {
    "llama": ("llama", dict(num_hidden_layers=5)),
    "mistral": ("llama", dict(model_type="mistral", num_hidden_layers=5, tie_word_embeddings=False)),
    "llama_sliding": ("llama", dict(num_hidden_layers=5, sliding_window=5,
                                    layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"])),
    "qwen2": ("qwen2", dict(SMALL, model_type="qwen2", tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(SMALL, model_type="qwen3", head_dim=8, max_position_embeddings=512,
                            tie_word_embeddings=True, rope_theta=10000.0)),
    "gemma3": ("gemma3_text", dict(SMALL, model_type="gemma3_text", head_dim=8, sliding_window=5,
                                   sliding_window_pattern=2, query_pre_attn_scalar=16, rope_theta=10000.0)),
    "minicpm": ("minicpm", dict(SMALL, model_type="minicpm", dim_model_base=8, scale_depth=1.4, scale_emb=3.0,
                                tie_word_embeddings=False)),
    "minicpm_tied": ("minicpm", dict(SMALL, model_type="minicpm", dim_model_base=8, scale_depth=1.4,
                                     scale_emb=3.0, tie_word_embeddings=True)),
}
VARIANTS = {
    "segmented": dict(segment_layers=2),
    "prefix": dict(segment_layers=2, prefix_sharing=True),
    "prefix_chunked": dict(segment_layers=3, prefix_sharing=True, head_chunk_tokens=7),
    "one_range": dict(segment_layers=0, prefix_sharing=True),  # no recompute (_step_whole)
}
NORM = Totals(nll_tokens=40.0, pairs=3.0)


def lora_model(name: str, seed: int = 0, **over):
    """A tiny random model with LoRA (rank 4) on all layers and random lora_b."""
    module, args = ARCHS[name]
    model = make_tiny_model(module, seed=seed, **{**args, **over})
    if name == "gemma3_tied":
        model.sanitize({})
    return add_random_lora(model, seed)


def make_pairs(seed: int = 0, n: int = 3, fallback: bool = False, lengths=((6, 4, 5), (3, 7, 2), (9, 2, 3))):
    """Pairs of different lengths (so the batch is padded); optionally a fallback pair."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(5, VOCAB) for _ in range(k)]  # noqa: E731
    pairs = [TokenizedPair(ids(p), ids(c), ids(r), source=f"t:{i}") for i, (p, c, r) in enumerate(lengths[:n])]
    if fallback:
        pairs[1] = TokenizedPair(pairs[1].prompt, pairs[1].chosen, pairs[1].rejected, "t:fb", rejected_prompt=ids(5))
    return pairs


def rel(a, b) -> float:
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_parity(model, engine, pairs, lam=0.1, norm=NORM):
    ref = ReferenceEngine(model, ORPO(lam)).step(pairs, norm)
    out = engine.step(pairs, norm)
    mx.eval(ref.loss, ref.grads, out.loss, out.grads)
    assert rel(out.loss, ref.loss) < 1e-5, (float(out.loss), float(ref.loss))
    for k in ("pairs", "nll_tokens"):
        assert out.sums[k] == ref.sums[k]
    for k, v in ref.sums.items():
        if k not in ("input_tokens", "fallback_pairs", "computed_tokens"):  # layout counts differ by design
            assert abs(float(out.sums[k]) - float(v)) <= 1e-5 * max(1.0, abs(float(v))), (k, out.sums[k], v)
    g_ref, g_out = dict(tree_flatten(ref.grads)), dict(tree_flatten(out.grads))
    assert g_ref.keys() == g_out.keys()
    for k in g_ref:
        assert rel(g_out[k], g_ref[k]) < 1e-4, (k, rel(g_out[k], g_ref[k]))
    ev_ref, ev = ReferenceEngine(model, ORPO(lam)).evaluate(pairs, norm), engine.evaluate(pairs, norm)
    assert rel(ev.loss, ev_ref.loss) < 1e-5
    assert ev.grads is None
    return out


def engine_for(model, lam=0.1, own_kernels=False, **kw):
    return SegmentedEngine(model, adapter_for(model, own_kernels), ORPO(lam), **kw)


@pytest.mark.parametrize("kernels", ["mlx", "dtrain"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity(arch, variant, kernels):
    """Against the reference engine (mlx-lm's own forward): with MLX's kernels and with dtrain's."""
    model = lora_model(arch)
    out = assert_parity(model, engine_for(model, own_kernels=kernels == "dtrain", **VARIANTS[variant]), make_pairs())
    prefix = VARIANTS[variant].get("prefix_sharing", False)
    # prefix sharing feeds each prompt once: 3 sequences of P + C + R tokens
    assert out.sums["input_tokens"] == (sum(p + c + r for p, c, r in ((6, 4, 5), (3, 7, 2), (9, 2, 3)))
                                        + (0 if prefix else 18))
    assert out.sums["fallback_pairs"] == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3", "minicpm"])
def test_parity_lambda_zero_and_fallback_pair(arch):
    model = lora_model(arch)
    engine = engine_for(model, lam=0.0, segment_layers=2, prefix_sharing=True, head_chunk_tokens=5)
    out = assert_parity(model, engine, make_pairs(fallback=True), lam=0.0)
    assert out.sums["fallback_pairs"] == 1


def test_gemma3_window_smaller_than_sequence():
    """Sliding window 3 over sequences up to 23 tokens, block-wise positions."""
    model = lora_model("gemma3", sliding_window=3)
    pairs = make_pairs(lengths=((10, 6, 7), (4, 9, 3), (12, 3, 8)))
    for kw in VARIANTS.values():
        for own in (False, True):
            assert_parity(model, engine_for(model, own_kernels=own, **kw), pairs)


@pytest.mark.parametrize("max_positions", [4, 64])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dynamic_ntk_rope(arch, max_positions):
    """mlx-lm's ``DynamicNTKScalingRoPE`` (``rope_scaling`` type ``dynamic``; gemma3: its global
    layers) widens its base once a sequence is longer than ``max_position_embeddings``: the 11-token
    rows of ``make_pairs`` are past 4 (gradients ~20% off a plain rope's), within 64; per-token
    positions gave the module an array offset (ValueError); now they give the reference's values."""
    model = lora_model(arch, rope_scaling={"type": "dynamic", "factor": 8.0}, max_position_embeddings=max_positions)
    for kw in VARIANTS.values():
        assert_parity(model, engine_for(model, **kw), make_pairs())
    assert_parity(model, engine_for(model, own_kernels=True, segment_layers=2, prefix_sharing=True, pack=True,
                                    length_bucket=8), make_pairs())


@pytest.mark.parametrize("size", [1, 3, 4, 5, 9, 0])
def test_segment_sizes(size):
    model = lora_model("qwen3")
    engine = engine_for(model, segment_layers=size, prefix_sharing=True)
    assert sum(hi - lo for lo, hi in engine.ranges) == 5
    assert_parity(model, engine, make_pairs())


def test_lora_on_some_layers_only():
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = make_tiny_model("llama", num_hidden_layers=5)
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 2.0, "dropout": 0.0})
    assert_parity(model, engine_for(model, segment_layers=2), make_pairs())


def test_range_functions_built_once_and_reused():
    model = lora_model("llama")
    engine = engine_for(model, segment_layers=2, prefix_sharing=True)
    fns = list(engine.range_fns)
    assert len(fns) == 3
    for seed in range(3):
        engine.step(make_pairs(seed), NORM)
    assert all(a is b for a, b in zip(fns, engine.range_fns)) and len(engine.range_fns) == 3


def test_params_restored_after_step():
    model = lora_model("llama")
    before = dict(tree_flatten(model.trainable_parameters()))
    engine_for(model, segment_layers=2).step(make_pairs(), NORM)
    after = dict(tree_flatten(model.trainable_parameters()))
    assert all(after[k] is before[k] for k in before)


def test_from_config_and_fallback_notice(capsys):
    cfg = Config()
    cfg.engine.kind, cfg.engine.segment_layers, cfg.engine.prefix_sharing = "segmented", 2, True
    engine = make_engine(cfg.engine, lora_model("llama"), ORPO(0.1))
    assert isinstance(engine, SegmentedEngine) and engine.ranges == [(0, 2), (2, 4), (4, 5)]
    assert engine.prefix_sharing and capsys.readouterr().err == ""

    other = make_tiny_model("phi3", **dict(SMALL, num_hidden_layers=2, model_type="phi3"))
    assert isinstance(make_engine(cfg.engine, other, ORPO(0.1)), ReferenceEngine)
    err = capsys.readouterr().err
    assert "does not support mlx-lm architecture 'phi3'; using the reference engine" in err


def test_factory_decides_each_fallback_and_reports_it_once():
    """make_engine is the one place that turns segmented into reference or drops compile."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    cfg = Config()
    cfg.engine.kind, cfg.engine.compile = "segmented", True
    notes = []
    model = lora_model("llama")
    model.model.norm.unfreeze()
    assert isinstance(make_engine(cfg.engine, model, ORPO(0.1), notes.append), ReferenceEngine)
    assert notes == ["the segmented engine differentiates only decoder-layer parameters; trainable outside them: "
                     "model.norm.weight; using the reference engine"]
    notes.clear()
    dropout = make_tiny_model("llama", seed=0, **ARCHS["llama"][1])
    dropout.freeze()
    linear_to_lora_layers(dropout, 2, {"rank": 4, "scale": 2.0, "dropout": 0.5})
    engine = make_engine(cfg.engine, dropout, ORPO(0.1), notes.append)
    assert isinstance(engine, SegmentedEngine) and not engine.compile
    assert notes == ["engine.compile is off: LoRA dropout draws new masks each step, which compiled ranges would "
                     "replay"]
    notes.clear()
    assert make_engine(cfg.engine, lora_model("llama"), ORPO(0.1), notes.append).compile and notes == []


def test_trainable_outside_layers_is_an_error():
    model = lora_model("llama")
    model.model.norm.unfreeze()
    with pytest.raises(ValueError, match="trainable outside them: model.norm.weight"):
        engine_for(model)


def test_mlx_causal_mask_aligns_bottom_right():
    """``mask="causal"`` with Lq < Lk: query i sees keys j <= i + Lk - Lq (relied on by SharedAttention)."""
    mx.random.seed(0)
    q = mx.random.normal((2, 4, 3, 8))
    k, v = mx.random.normal((2, 2, 7, 8)), mx.random.normal((2, 2, 7, 8))
    explicit = mx.arange(7)[None, :] <= mx.arange(3)[:, None] + 4  # (Lq, Lk)
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
    assert np.allclose(fused, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=explicit), atol=1e-6)
    top_left = mx.arange(7)[None, :] <= mx.arange(3)[:, None]
    assert not np.allclose(fused, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=top_left), atol=1e-3)


def test_shared_attention_equals_explicit_mask_on_mixed_batch():
    """Shared rows of different lengths, a fallback pair's two rows, padding: the batched
    plan equals the explicit block-sparse mask on every real query, with and without buckets."""
    from dtrain.engine.arch import shared_attention
    from dtrain.engine.attention import SharedAttention, attention_mask, attention_plan
    from dtrain.engine.layout import shared_prefix_layout

    # rows: [P; C] and [P; R] of each shared sequence, one row per fallback sequence: lengths 10, 11, 10,
    # 7, 11, 12; the [P; R] rows (11 and 12) need queries from 6 and 9 on. Exact: [12 from 9] alone
    # (144 - 81 = 63), [11, 11, 10, 10] (4 * 121) and [7] (49): 596 / 0.9² = 736, against one call 6 *
    # 144 = 864, two calls at best 63 + 5 * 121 = 668 (/ 0.9 = 742), four at best 560 (/ 0.9³ = 768);
    # buckets of 4 (12 x 5, 8; starts 8 and 4): any split rounds row counts to powers of two and costs
    # more than one call, 6 x 12 (e.g. [12, 11 from 4] + [11, 10, 10, 7]: 256 + 576 = 832, / 0.9 = 924)
    for bucket, L, shapes, starts in ((0, 15, ((1, 12), (4, 11), (1, 7)), (9, 0, 0)), (4, 16, ((6, 12),), (0,))):
        layout = shared_prefix_layout(make_pairs(fallback=True, lengths=((6, 4, 5), (3, 7, 2), (9, 2, 3))), bucket=bucket)
        S = layout.shape[0]
        assert layout.spans == ((6, 4, 5), (3, 7, 0), (5, 2, 0), (9, 2, 3)) and layout.shape == (4, L)
        plan = attention_plan(layout)
        assert isinstance(plan, SharedAttention) and plan.shapes == shapes and plan.starts == starts
        assert tuple(g.shape for g in plan.gathers) == shapes and plan.scatter.shape == (S * L,)
        mx.random.seed(1)
        q, k, v = mx.random.normal((S, 4, L, 8)), mx.random.normal((S, 2, L, 8)), mx.random.normal((S, 2, L, 8))
        fused = np.array(shared_attention(q, k, v, 0.35, plan))  # (S, L, H * Dh)
        explicit = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=attention_mask(layout)))
        real = np.array(layout.blocks) >= 0  # (S, L)
        assert np.allclose(fused[real], explicit.transpose(0, 2, 1, 3).reshape(S, L, -1)[real], atol=1e-5)


def test_unwindowed_prefix_sharing_builds_no_mask_array(monkeypatch):
    """Without a sliding window the plan holds index arrays only (no (L, L) mask), and a
    whole step (mixed batch with a fallback pair) never calls the (S, 1, L, L) mask builder."""
    import dtrain.engine.attention as attention_mod
    import dtrain.engine.layout as layout_mod

    layout = layout_mod.shared_prefix_layout(make_pairs(fallback=True))
    plan = attention_mod.attention_plan(layout)
    assert isinstance(plan, attention_mod.SharedAttention)
    assert all(g.dtype == mx.int32 and g.ndim == 2 for g in plan.gathers) and plan.scatter.ndim == 1
    assert attention_mod.attention_plan(layout_mod.two_sequence_layout(make_pairs())) == "causal"
    assert attention_mod.attention_plan(layout, window=5).shape == (3 + 1, 1, 15, 15)  # sliding layers keep the mask

    def no_mask(*_, **__):
        raise AssertionError("attention_mask called for an unwindowed layout")

    monkeypatch.setattr(attention_mod, "attention_mask", no_mask)
    for arch in ("llama", "qwen3"):
        model = lora_model(arch)
        out = assert_parity(model, engine_for(model, segment_layers=2, prefix_sharing=True), make_pairs(fallback=True))
        assert out.sums["fallback_pairs"] == 1


def dropout_model(dtype=mx.float32):
    """The llama test model with LoRA dropout 0.5 on every layer (random LoRA weights)."""
    from mlx.utils import tree_map
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = make_tiny_model("llama", seed=0, **ARCHS["llama"][1])
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 4, "scale": 2.0, "dropout": 0.5})
    model.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), model.trainable_parameters()))
    model.set_dtype(dtype)
    model.train()
    return model


def test_lora_dropout_gradient_matches_finite_differences_of_the_same_masks():
    """With LoRA dropout on, each range's recompute draws the masks its forward
    drew (the key the range started from), so the gradient is that of the loss
    that was run: checked by central differences of ``evaluate`` under the same key (float64)."""
    from mlx.utils import tree_map

    model = dropout_model(mx.float64)
    engine = SegmentedEngine(model, adapter_for(model), ORPO(0.1, "full"), segment_layers=2, prefix_sharing=True)
    pairs = make_pairs()
    norm = batch_totals(pairs, "full")
    key = mx.random.key(123)
    grads = engine.step(pairs, norm, key).grads
    params = model.trainable_parameters()
    mx.random.seed(5)
    direction = tree_map(lambda p: mx.random.normal(p.shape).astype(mx.float64), params)

    def along(eps):
        model.update(tree_map(lambda p, d: p + eps * d, params, direction))
        return engine.evaluate(pairs, norm, key).loss.item()  # the same key, hence the same dropout masks

    d = lambda h: (along(h) - along(-h)) / (2 * h)  # noqa: E731
    fd = (4 * d(2e-3) - d(4e-3)) / 3  # Richardson: cancels the O(h^2) term
    model.update(params)
    analytic = sum((g * v).sum().item() for (_, g), (_, v) in zip(tree_flatten(grads), tree_flatten(direction)))
    assert analytic == pytest.approx(fd, rel=2e-4)
    # another key gives other masks, hence another loss: dropout is really on
    assert engine.evaluate(pairs, norm, mx.random.key(124)).loss.item() != pytest.approx(along(0.0), rel=1e-6)


@pytest.mark.parametrize("kw", [dict(segment_layers=2), dict(segment_layers=2, head_chunk_tokens=7),
                                dict(segment_layers=0)])
def test_lora_dropout_segmented_equals_reference_and_repeats_bitwise(kw):
    """One dropout key: the segmented engine (two-sequence layout, so the same shapes) draws
    the reference engine's masks, range by range and again in each recompute; the same key
    twice gives bitwise equal gradients; nothing reads or seeds MLX's global generator."""
    model = dropout_model()
    engine = engine_for(model, **kw)
    pairs, key = make_pairs(), mx.random.key(7)
    before = np.array(mx.random.state[0])
    ref = ReferenceEngine(model, ORPO(0.1)).step(pairs, NORM, key)
    out, again = engine.step(pairs, NORM, key), engine.step(pairs, NORM, key)
    other = engine.step(pairs, NORM, mx.random.key(8))
    mx.eval(ref.grads, out.grads, again.grads, other.grads)
    assert np.array_equal(np.array(mx.random.state[0]), before)  # the global generator did not move
    g_ref, g_out, g_again, g_other = (dict(tree_flatten(r.grads)) for r in (ref, out, again, other))
    assert rel(out.loss, ref.loss) < 1e-5
    for k in g_ref:
        assert rel(g_out[k], g_ref[k]) < 1e-4, (k, rel(g_out[k], g_ref[k]))
        assert np.array_equal(np.array(g_out[k]), np.array(g_again[k])), k
    assert max(rel(g_other[k], g_out[k]) for k in g_out) > 1e-2  # other masks: other gradients
    with pytest.raises(ValueError, match="LoRA dropout is on but no key was given"):
        engine.step(pairs, NORM)


@pytest.mark.parametrize("size, chunk, runs", [(2, 7, [2] * 5), (0, 7, [2] * 5), (2, 0, [2] * 5), (0, 0, [1] * 5)])
def test_one_range_without_chunked_head_runs_each_layer_once(size, chunk, runs):
    """Layer executions per step: forward + recompute inside the vjp, except for
    one range with an unchunked head, which is one value_and_grad (no recompute)."""
    import dataclasses

    model = lora_model("llama")
    arch = adapter_for(model)
    counts = [0] * len(arch.layers)
    index = {id(layer): i for i, layer in enumerate(arch.layers)}

    def counting(layer, *args):
        counts[index[id(layer)]] += 1
        return arch.layer_call(layer, *args)

    engine = SegmentedEngine(model, dataclasses.replace(arch, layer_call=counting), ORPO(0.1),
                             segment_layers=size, prefix_sharing=True, head_chunk_tokens=chunk)
    out = engine.step(make_pairs(), NORM)
    mx.eval(out.loss, out.grads)
    assert counts == runs
    assert_parity(model, SegmentedEngine(model, arch, ORPO(0.1), segment_layers=size, prefix_sharing=True,
                                         head_chunk_tokens=chunk), make_pairs())


@pytest.mark.parametrize("size, chunk, noticed", [(0, 8, True), (5, 8, True), (2, 8, False), (0, 0, False)])
def test_one_range_with_chunked_head_gets_a_notice(capsys, size, chunk, noticed):
    cfg = Config()
    cfg.engine.kind, cfg.engine.segment_layers, cfg.engine.head_chunk_tokens = "segmented", size, chunk
    make_engine(cfg.engine, lora_model("llama"), ORPO(0.1))  # 5 layers
    assert ("head_chunk_tokens: 0 gives the single pass" in capsys.readouterr().err) == noticed


def generated_model(rng: random.Random):
    """A tiny float32 model drawn from ``rng``: llama (grouped or odd head counts, a head size apart from
    the hidden size, biases, traditional, llama3, linear or dynamic RoPE, sliding layers), qwen3, qwen2,
    minicpm or gemma3 (a window of 1-8 over longer rows, a global layer every 1-n), tied or untied, with
    dtrain's LoRA (some layers, some keys, rsLoRA) and random ``lora_b``."""
    from mlx.utils import tree_unflatten

    from dtrain.config import LoraConfig
    from dtrain.lora import apply_lora

    arch, n, heads, hd = rng.choice(["llama", "llama", "qwen3", "qwen2", "minicpm", "gemma3"]), rng.randint(2, 4), \
        rng.randint(1, 6), rng.choice([4, 6, 8])
    args = dict(hidden_size=heads * hd, num_hidden_layers=n, intermediate_size=rng.choice([16, 48]),
                num_attention_heads=heads, num_key_value_heads=rng.choice([d for d in range(1, 7) if heads % d == 0]),
                rms_norm_eps=1e-5, vocab_size=128, tie_word_embeddings=rng.random() < 0.5, rope_theta=10000.0)
    if arch == "llama":
        args.update(hidden_size=rng.choice([16, 32]), head_dim=hd, rope_traditional=rng.random() < 0.3,
                    attention_bias=rng.random() < 0.3, mlp_bias=rng.random() < 0.3, max_position_embeddings=16,
                    rope_scaling=rng.choice([None, None, {"type": "linear", "factor": 2.0},
                                             {"type": "dynamic", "factor": 8.0},
                                             {"rope_type": "llama3", "factor": 8.0,
                                              "original_max_position_embeddings": 16}]))
        if rng.random() < 0.4:  # mlx-lm needs one full-attention layer
            args.update(sliding_window=rng.randint(1, 8), layer_types=["full_attention"] + [
                rng.choice(["sliding_attention", "full_attention"]) for _ in range(n - 1)])
    elif arch == "gemma3":
        args.update(model_type="gemma3_text", head_dim=hd, sliding_window=rng.randint(1, 8),
                    sliding_window_pattern=rng.randint(1, n), query_pre_attn_scalar=rng.choice([8, 16]))
    elif arch == "qwen3":
        args.update(model_type="qwen3", head_dim=hd, max_position_embeddings=512)
    elif arch == "minicpm":
        args.update(model_type="minicpm", dim_model_base=8, scale_depth=1.4, scale_emb=3.0)
    else:
        args.update(model_type="qwen2")
    model = make_tiny_model("gemma3_text" if arch == "gemma3" else arch, seed=rng.randrange(100), **args)
    if arch == "gemma3" and args["tie_word_embeddings"]:
        model.sanitize({})  # no lm_head weight: tied, as a checkpoint without one loads
    keys = rng.choice([None, None, ["self_attn.q_proj"], ["self_attn.v_proj", "mlp.down_proj"]])
    apply_lora(model, LoraConfig(rank=rng.choice([1, 4]), scale=2.0, num_layers=rng.choice([-1, -1, 1]), keys=keys,
                                 rslora=rng.random() < 0.3, branch_dtype="float32"))
    mx.random.seed(rng.randrange(100))
    model.update(tree_unflatten([(k, 0.1 * mx.random.normal(v.shape))
                                 for k, v in tree_flatten(model.trainable_parameters()) if k.endswith("lora_b")]))
    return model, args


def generated_pairs(rng: random.Random, objective) -> list[TokenizedPair]:
    """1-5 pairs: prompts of 1-40 tokens, sides of 1-30 (never equal: no tie for rounding to decide),
    some rejected sides under their own prompt, SFT rows under SFT, DPO's reference log-probabilities."""
    from dtrain.engine import DPO, SFT

    ids = lambda k: [rng.randrange(0 if rng.random() < 0.1 else 3, 128) for _ in range(k)]  # noqa: E731
    pairs = []
    for i in range(rng.randint(1, 5)):
        prompt, chosen, rejected = (ids(rng.choice([1, rng.randint(1, hi)])) for hi in (40, 30, 30))
        rejected = rejected if rejected != chosen else rejected + [1]
        own_prompt = ids(rng.randint(1, 40)) if rng.random() < 0.2 else None
        if isinstance(objective, SFT) and rng.random() < 0.5:
            rejected, own_prompt = [], None
        extra = ({k: -rng.uniform(1, 80) for k in ("ref_chosen", "ref_rejected")} if isinstance(objective, DPO)
                 else None)
        pairs.append(TokenizedPair(prompt, chosen, rejected, f"g:{i}", own_prompt, extra))
    return pairs


@pytest.mark.parametrize("seed", range(40))
def test_generated_models_pairs_and_settings_float32(seed):
    """Generated cases in float32 (``generated_model``, ``generated_pairs``, any objective, the engine's
    ranges, head chunk, prefix sharing, packing, buckets, attention calls, kernels, compile): over the same
    micro-batches (a dynamic RoPE's base follows each micro-batch's longest row), metric sums of step and
    evaluation and every LoRA gradient equal the reference engine's."""
    from dtrain.engine import DPO, SFT, SimPO, run_micro_batches
    from dtrain.sampler import micro_batches

    rng = random.Random(seed)
    model, args = generated_model(rng)
    obj = rng.choice([ORPO(rng.choice([0.1, 1.0]), rng.choice(["full", "response"])), DPO(0.1), DPO(0.5, "ipo"),
                      DPO(0.1, "hinge"), SimPO(2.0, 0.5, rng.choice([0.0, 0.5])),
                      SFT(rng.choice(["full", "response"]))])
    pairs = generated_pairs(rng, obj)
    kw = dict(segment_layers=rng.choice([0, 1, 2, args["num_hidden_layers"], "auto"]),
              memory_budget=rng.choice([1e3, 1e12]),  # auto: no plan fits / the single pass fits
              prefix_sharing=rng.random() < 0.6, head_chunk_tokens=rng.choice([0, 0, 1, 7]),
              length_bucket=rng.choice([0, 4, 16]), pack=rng.random() < 0.4, attention_groups=rng.randint(1, 4),
              compile=rng.random() < 0.2)
    engine = SegmentedEngine(model, adapter_for(model, rng.random() < 0.5), obj, **kw)
    chunks, totals = micro_batches(pairs, rng.randint(1, len(pairs))), batch_totals(pairs, obj.nll_scope)
    (ref_sums, ref_grads), (sums, grads) = (run_micro_batches(e, chunks, totals, True)
                                            for e in (ReferenceEngine(model, obj), engine))
    evaluated, _ = run_micro_batches(engine, chunks, totals, False)
    case = (seed, args, obj, kw, [(len(p.prompt), len(p.chosen), len(p.rejected)) for p in pairs])
    for k in set(obj.metric_keys) - {"input_tokens", "fallback_pairs", "computed_tokens"}:  # layouts differ
        for got in (sums, evaluated):
            assert abs(got[k] - ref_sums[k]) <= 1e-4 * max(1.0, abs(ref_sums[k])), (k, got[k], ref_sums[k], case)
    g, want = dict(tree_flatten(grads)), dict(tree_flatten(ref_grads))
    assert g.keys() == want.keys()
    flat = lambda t: np.concatenate([np.array(t[k], np.float64).ravel() for k in want])  # noqa: E731
    assert rel(flat(g), flat(want)) < 1e-4, case
    floor = 1e-3 * np.linalg.norm(flat(want))  # a parameter whose gradient is near zero: against the whole one
    for k in want:
        err = np.linalg.norm(np.array(g[k], np.float64) - np.array(want[k], np.float64))
        assert err <= 1e-3 * max(np.linalg.norm(np.array(want[k], np.float64)), floor), (k, case)
