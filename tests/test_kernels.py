"""dtrain's own kernels (dtrain/engine/kernels.py) against MLX's ops and finite differences.

Values and vjps are compared in float64 (MLX's CPU runs it), where the two
ways of computing the same function must agree to ~1e-12, and in float32; the
attention runs on grouped-query shapes whose length is not a multiple of the
query block, so the last block is partial.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dtrain.config import Config
from dtrain.engine import ORPO, Totals, make_engine
from dtrain.engine import kernels
from dtrain.engine.arch import fused_causal
from dtrain.engine.segmented import SegmentedEngine
from mlx.utils import tree_flatten

from conftest import add_random_lora, make_tiny_model

F64 = mx.float64


def rel(a, b) -> float:
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def normal(shape, seed, dtype=F64, scale=3.0):
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def vjp_of(f, x, w):
    """``d sum(w * f(x)) / dx``."""
    return mx.grad(lambda t: (w * f(t)).sum())(x)


def numpy_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def numpy_logsumexp(x):
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


ELEMENTWISE = {  # ours, MLX's, numpy's
    "exp": (kernels.exp, mx.exp, np.exp),
    "sigmoid": (kernels.sigmoid, mx.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    "softmax": (kernels.softmax, lambda x: mx.softmax(x, axis=-1), numpy_softmax),
    "logsumexp": (kernels.logsumexp, lambda x: mx.logsumexp(x, axis=-1), numpy_logsumexp),
    "swiglu": (lambda x: kernels.swiglu(x, x[..., ::-1]), lambda x: nn.silu(x) * x[..., ::-1],
               lambda x: x / (1 + np.exp(-x)) * x[..., ::-1]),
}


def finite_difference_vjp(f, x, w, h=1e-6):
    """Central differences of ``sum(w * f(x))`` in float64, element by element."""
    flat, out = x.reshape(-1), np.zeros(x.size)
    for i in range(x.size):
        e = mx.zeros((x.size,), F64).at[i].add(h)
        up, down = (w * f((flat + e).reshape(x.shape))).sum(), (w * f((flat - e).reshape(x.shape))).sum()
        out[i] = (up.item() - down.item()) / (2 * h)
    return out.reshape(x.shape)


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_float64_values_and_vjps_are_exact(name):
    """float64: the values equal numpy's formula to 1e-13 (MLX's own float64 ``exp`` is only
    float32-accurate, so it is not the yardstick), the vjps equal finite differences."""
    ours, _, formula = ELEMENTWISE[name]
    x = normal((3, 7), 0)
    y = ours(x)
    assert y.dtype == F64 and rel(y, formula(np.array(x))) < 1e-13
    w = normal(y.shape, 1, scale=1.0)
    assert rel(vjp_of(ours, x, w), finite_difference_vjp(ours, x, w)) < 1e-8


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_float32_values_and_vjps_equal_mlx(name):
    ours, theirs, _ = ELEMENTWISE[name]
    x = normal((3, 5, 17), 0, mx.float32)
    y, want = ours(x), theirs(x)
    assert y.dtype == want.dtype == mx.float32 and y.shape == want.shape
    assert rel(y, want) < 2e-6
    w = normal(want.shape, 1, mx.float32, 1.0)
    assert rel(vjp_of(ours, x, w), vjp_of(theirs, x, w)) < 2e-5


def test_masked_entries_get_zero_weight_and_large_logits_stay_finite():
    x = mx.array([[0.0, -math.inf, 2.0, -math.inf], [800.0, 799.0, -math.inf, 0.0]], F64)
    p = kernels.softmax(x)
    assert np.array(p)[0, 1] == 0.0 and np.array(p)[0, 3] == 0.0 and np.array(p)[1, 2] == 0.0
    assert rel(p, numpy_softmax(np.array(x))) < 1e-14
    assert rel(kernels.logsumexp(x), numpy_logsumexp(np.array(x))) < 1e-14
    g = vjp_of(kernels.softmax, x, mx.ones_like(x) * mx.arange(4).astype(F64))
    assert np.isfinite(np.array(g)).all() and np.array(g)[0, 1] == 0.0
    s = kernels.sigmoid(mx.array([-800.0, 0.0, 800.0], F64))
    assert np.array(s).tolist() == [0.0, 0.5, 1.0]


def reference_attention(q, k, v, scale):
    """Causal attention written out in numpy (float64), grouped queries repeated."""
    q, k, v = (np.array(t, np.float64) for t in (q, k, v))
    r = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    s = scale * q @ k.swapaxes(-1, -2)
    L = q.shape[2]
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("block", [0, 1, 3, 4, 11, 64])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_causal_attention_equals_the_written_out_product(block, heads):
    H, Hkv = heads
    L, Dh, scale = 11, 8, 8 ** -0.5
    q, k, v = normal((2, H, L, Dh), 5, scale=1.0), normal((2, Hkv, L, Dh), 6, scale=1.0), normal((2, Hkv, L, Dh), 7)
    out = kernels.causal_attention(q, k, v, scale, block)
    assert out.shape == (2, H, L, Dh) and out.dtype == F64
    assert rel(out, reference_attention(q, k, v, scale)) < 1e-12


@pytest.mark.parametrize("block", [0, 4, 128])
def test_causal_attention_vjp_equals_mlx_fused_attention(block):
    """float32, where MLX's fused attention runs: the vjps of q, k and v agree."""
    q, k, v = (normal((1, 4, 37, 16), s, mx.float32, 1.0) for s in (8, 9, 10))
    k, v = k[:, :2], v[:, :2]
    w = normal((1, 4, 37, 16), 11, mx.float32, 1.0)

    def loss(fn):
        return lambda q, k, v: (w * fn(q, k, v, 0.25)).sum()

    ours = mx.grad(loss(lambda *a: kernels.causal_attention(*a, block=block)), argnums=(0, 1, 2))(q, k, v)
    theirs = mx.grad(loss(fused_causal), argnums=(0, 1, 2))(q, k, v)
    assert rel(kernels.causal_attention(q, k, v, 0.25, block), fused_causal(q, k, v, 0.25)) < 2e-6
    for a, b in zip(ours, theirs):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("block", [0, 1, 3, 64])
@pytest.mark.parametrize("lq", [1, 4, 7, 11])
def test_fewer_queries_are_the_last_positions_as_in_mlx(block, lq):
    """``Lq < Lk``: the queries are the last ``Lq`` of the ``Lk`` positions (MLX's ``"causal"``
    with fewer queries): the written-out product's last rows in float64, and MLX's fused
    attention with its vjps in float32."""
    Lk, Dh, scale = 11, 8, 8 ** -0.5
    q, k, v = normal((2, 4, Lk, Dh), 21, scale=1.0), normal((2, 2, Lk, Dh), 22, scale=1.0), normal((2, 2, Lk, Dh), 23)
    out = kernels.causal_attention(q[:, :, Lk - lq:], k, v, scale, block)
    assert out.shape == (2, 4, lq, Dh)
    assert rel(out, reference_attention(q, k, v, scale)[:, :, Lk - lq:]) < 1e-12
    q32, k32, v32 = (t.astype(mx.float32)[..., Lk - lq:, :] if i == 0 else t.astype(mx.float32)
                     for i, t in enumerate((q, k, v)))
    w = normal((2, 4, lq, Dh), 24, mx.float32, 1.0)
    ours = mx.grad(lambda *a: (w * kernels.causal_attention(*a, scale, block)).sum(), argnums=(0, 1, 2))(q32, k32, v32)
    theirs = mx.grad(lambda *a: (w * fused_causal(*a, scale)).sum(), argnums=(0, 1, 2))(q32, k32, v32)
    for a, b in zip(ours, theirs):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("wrt", [0, 1, 2])
def test_causal_attention_vjp_matches_finite_differences(wrt):
    """float64, two heads over one key/value head, blocks of 2 over 5 queries."""
    qkv = [normal((1, 2, 5, 3), 12, scale=1.0), normal((1, 1, 5, 3), 13, scale=1.0), normal((1, 1, 5, 3), 14)]
    w = normal((1, 2, 5, 3), 15, scale=1.0)

    def f(t):
        args = list(qkv)
        args[wrt] = t
        return kernels.causal_attention(*args, 0.5, block=2)

    g = vjp_of(f, qkv[wrt], w)
    assert rel(g, finite_difference_vjp(f, qkv[wrt], w)) < 1e-8


def test_the_config_key_picks_the_kernels():
    """``engine.kernels`` reaches the engine's layer function and head: ``dtrain`` swaps in
    this module's log-sum-exp, ``mlx`` keeps MLX's; both give the same step to rounding."""
    model = add_random_lora(make_tiny_model("llama", seed=0, num_hidden_layers=3), 0)
    cfg = Config()
    cfg.engine.kind, cfg.engine.segment_layers, cfg.engine.prefix_sharing = "segmented", 0, True
    from dtrain.types import TokenizedPair

    pairs = [TokenizedPair(list(range(5, 14)), list(range(20, 26)), list(range(30, 33)), "t:0"),
             TokenizedPair(list(range(40, 43)), list(range(50, 57)), list(range(60, 62)), "t:1")]
    norm = Totals(nll_tokens=30.0, pairs=2.0)
    out = {}
    for name in ("mlx", "dtrain"):
        cfg.engine.kernels = name
        engine = make_engine(cfg.engine, model, ORPO(0.1))
        assert isinstance(engine, SegmentedEngine)
        assert (engine.arch.logsumexp is kernels.logsumexp) == (name == "dtrain")
        out[name] = engine.step(pairs, norm)
    assert rel(out["dtrain"].loss, out["mlx"].loss) < 1e-6
    g_mlx, g_own = dict(tree_flatten(out["mlx"].grads)), dict(tree_flatten(out["dtrain"].grads))
    assert g_mlx.keys() == g_own.keys()
    assert max(rel(g_own[k], g_mlx[k]) for k in g_mlx) < 1e-4


def test_gemma4_takes_the_head_kernel_and_keeps_the_reference_gradients():
    pytest.importorskip("mlx_lm.models.gemma4_text")
    from test_engine_gemma4 import PAIRS, gemma4_model
    from test_engine_segmented import assert_parity, engine_for, make_pairs

    model = gemma4_model("gemma4")
    engine = engine_for(model, own_kernels=True, segment_layers=3, prefix_sharing=True, head_chunk_tokens=7)
    assert engine.arch.name == "gemma4_text" and engine.arch.logsumexp is kernels.logsumexp
    assert_parity(model, engine, make_pairs(**PAIRS))
