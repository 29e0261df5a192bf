"""The reference engine: gradients against central finite differences, layout
counts, and the loss against a direct computation from mlx-lm's logits."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import make_tiny_model
from dtrain.config import LoraConfig
from dtrain.engine import ReferenceEngine, Totals
from dtrain.engine.attention import attention_mask
from dtrain.engine.layout import shared_prefix_layout, two_sequence_layout
from dtrain.lora import apply_lora
from dtrain.engine import ORPO
from dtrain.types import TokenizedPair

PAIRS = [
    TokenizedPair([1, 5, 6, 7], [8, 9, 2], [10, 2], "a:1"),
    TokenizedPair([1, 5], [11, 12, 13, 2], [14, 15, 16, 17, 2], "a:2"),
]


def lora_model(dtype=mx.float32, seed=0):
    model = make_tiny_model(seed=seed)
    apply_lora(model, LoraConfig(rank=2, scale=2.0))
    mx.random.seed(seed + 1)
    # mlx-lm starts lora_b at zero; random values make every gradient non-trivial
    model.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), model.trainable_parameters()))
    model.set_dtype(dtype)
    return model


def test_layout_counts_and_targets():
    lay = two_sequence_layout(PAIRS)
    # NLL over [prompt; chosen] predictions: (4+3-1) + (2+4-1) = 11
    assert lay.nll_tokens == 11 and lay.n_pairs == 2 and lay.shape == (4, 7)
    assert lay.input_tokens == 7 + 6 + 6 + 7
    resp = two_sequence_layout(PAIRS, nll_scope="response")
    assert resp.nll_tokens == 3 + 4
    shared = shared_prefix_layout(PAIRS)
    assert shared.shape == (2, 11) and shared.input_tokens == 9 + 11
    # same multiset of (pair, target, roles) in both layouts
    def targets(l):
        cols = [l.pair_of, l.targets, l.w_nll, l.w_chosen, l.w_rejected]
        return sorted(zip(*[np.array(c).tolist() for c in cols]))
    assert targets(lay) == targets(shared)
    # block-wise positions: rejected restarts at the prompt length
    assert np.array(shared.positions)[0, :9].tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5]


def test_shared_prefix_mask_hides_chosen_from_rejected():
    lay = shared_prefix_layout(PAIRS[:1])  # P=4, C=3, R=2
    m = np.array(attention_mask(lay))[0, 0]
    assert m[7, :4].all() and not m[7, 4:7].any() and m[7, 7]  # first rejected token
    assert m[6, :7].all() and not m[6, 7:].any()  # last chosen token: plain causal


def test_loss_equals_direct_computation_from_mlx_lm_logits():
    model = lora_model()
    norm = Totals(nll_tokens=11, pairs=2)
    result = ReferenceEngine(model, ORPO(0.1)).step(PAIRS, norm)
    # direct: per side, log-softmax of mlx-lm's logits
    def side_logps(prompt, resp):
        seq = prompt + resp
        logits = model(mx.array([seq]))[0]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return [lp[t, seq[t + 1]].item() for t in range(len(seq) - 1)]
    nll, ors = 0.0, 0.0
    for p in PAIRS:
        c = side_logps(p.prompt, p.chosen)
        r = side_logps(p.prompt, p.rejected)
        nll -= sum(c)
        lw = sum(c[len(p.prompt) - 1 :]) / len(p.chosen)
        lr = sum(r[len(p.prompt) - 1 :]) / len(p.rejected)
        lo = (lw - lr) - (math.log(-math.expm1(lw)) - math.log(-math.expm1(lr)))
        ors += math.log1p(math.exp(-lo))
    assert result.loss.item() == pytest.approx(nll / 11 + 0.1 * ors / 2, rel=1e-5)


def central_difference(f, h):
    """Richardson-extrapolated central difference of ``f(eps)`` at 0: the
    O(h^2) error term cancels, so a larger ``h`` can be used. (MLX's fused
    CPU kernels carry some float32 rounding even for float64 inputs, ~1e-8 in
    the loss, which rules out tiny steps.)"""
    d = lambda s: (f(s) - f(-s)) / (2 * s)
    return (4 * d(h / 2) - d(h)) / 3


@pytest.mark.parametrize("lam, scope", [(0.1, "full"), (1.0, "response"), (0.0, "full")])
def test_lora_gradients_match_central_finite_differences(lam, scope):
    """Directional derivatives along random directions, and single elements."""
    model = lora_model(mx.float64)
    engine = ReferenceEngine(model, ORPO(lam, scope))
    norm = Totals(nll_tokens=11 if scope == "full" else 7, pairs=2)
    grads = engine.step(PAIRS, norm).grads
    params = model.trainable_parameters()
    mx.random.seed(7)
    for _ in range(2):
        direction = tree_map(lambda p: mx.random.normal(p.shape).astype(mx.float64), params)
        def along(eps):
            model.update(tree_map(lambda p, d: p + eps * d, params, direction))
            return engine.evaluate(PAIRS, norm).loss.item()

        fd = central_difference(along, 4e-3)
        model.update(params)
        analytic = sum((g * d).sum().item() for (_, g), (_, d) in zip(tree_flatten(grads), tree_flatten(direction)))
        assert analytic == pytest.approx(fd, rel=2e-4)
    # each element for one tensor
    name, g = tree_flatten(grads)[0]
    flat = dict(tree_flatten(params))
    base = flat[name]
    for idx in [(0, 0), (3, 1)]:
        def bump(eps):
            w = np.array(base)
            w[idx] += eps
            model.load_weights([(name, mx.array(w))], strict=False)
            return engine.evaluate(PAIRS, norm).loss.item()

        fd = central_difference(bump, 1e-2)
        model.load_weights([(name, base)], strict=False)
        assert np.array(g)[idx] == pytest.approx(fd, rel=1e-3, abs=5e-6)
        assert abs(fd) > 1e-4  # a non-trivial gradient was checked
