"""Chunked LM head: same log-probabilities and gradients as the whole head,
with memory bounded by the chunk."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dtrain.engine.head import hidden_grad, token_logps


def linear_head(D: int, V: int, seed: int = 0):
    mx.random.seed(seed)
    w = mx.random.normal((V, D)) / D**0.5
    mx.eval(w)
    return lambda h: mx.fast.rms_norm(h, None, 1e-6) @ w.T  # (n, D) -> (n, V)


def test_chunks_match_whole_head_and_autograd():
    head = linear_head(16, 300)
    targets = mx.random.randint(0, 300, (37,))
    rows = mx.array([0, 1, 1, 5] + list(range(6, 39)))  # row 1 predicts two targets (prefix sharing)
    weights = mx.random.normal((37,))

    def direct(hidden):  # (40, D) -> scalar, the loss the chunked path must reproduce
        logits = head(hidden[rows])
        lp = mx.take_along_axis(logits, targets[:, None], -1)[:, 0] - mx.logsumexp(logits, -1)
        return (lp * weights).sum(), lp

    hidden = mx.random.normal((40, 16))
    (_, lp_ref), g_ref = mx.value_and_grad(direct)(hidden)
    for chunk in (0, 1, 5, 37, 100):
        lp, jac = token_logps(head, hidden[rows], targets, chunk)
        np.testing.assert_allclose(lp, lp_ref, rtol=1e-6, atol=1e-6)
        g = hidden_grad(weights, jac, rows, 40)
        np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)
        lp_only, none = token_logps(head, hidden[rows], targets, chunk, with_jacobian=False)
        assert none is None and np.allclose(lp_only, lp_ref, atol=1e-6)


def test_chunked_head_peak_memory_is_bounded():
    """Whole head: (N, V) logits and their gradient; chunks of 16 rows: ~16/N of that."""
    N, D, V = 512, 32, 16384
    head = linear_head(D, V)
    h = mx.random.normal((N, D))
    targets = mx.random.randint(0, V, (N,))
    mx.eval(h, targets)

    def peak(chunk):
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        token_logps(head, h, targets, chunk)
        return mx.get_peak_memory() - base

    whole, chunked = peak(0), peak(16)
    logits_bytes = N * V * 4  # 32 MiB
    assert whole >= logits_bytes
    assert chunked < 0.1 * whole, (chunked, whole)


def test_float64_head_keeps_float64_as_the_reference_engine_does():
    """A float64 model's log-probabilities stay float64 (``loss.upcast``, as the reference engine's
    ``gather_token_logps``): the segmented engine's metric sums equal the reference's to float64
    rounding, chunked head or not (they differed by float32 rounding, ~1e-7, when the head cast to float32)."""
    from dtrain.engine import ORPO, ReferenceEngine, batch_totals
    from dtrain.engine.arch import adapter_for
    from dtrain.engine.segmented import SegmentedEngine

    from test_engine_segmented import lora_model, make_pairs

    model = lora_model("llama")
    model.set_dtype(mx.float64)
    pairs = make_pairs()
    totals = batch_totals(pairs, "full")
    ref = ReferenceEngine(model, ORPO(0.1)).evaluate(pairs, totals)
    for kw in (dict(segment_layers=2), dict(segment_layers=2, head_chunk_tokens=5), dict(segment_layers=0)):
        engine = SegmentedEngine(model, adapter_for(model), ORPO(0.1), **kw)
        for out in (engine.step(pairs, totals), engine.evaluate(pairs, totals)):
            assert out.loss.dtype == mx.float64
            for k, v in ref.sums.items():
                assert abs(float(out.sums[k]) - float(v)) <= 1e-13 * max(1.0, abs(float(v))), (kw, k)


def test_chunks_run_one_after_another_not_two_at_once():
    """The head's peak over many chunks is one chunk's, as the docstring says: with each chunk only
    scheduled (``mx.async_eval``), the next chunk's logits were made while the last one's were alive,
    so 8 chunks of 64 rows peaked at 1.5x (MLX's log-sum-exp) to 1.8x (dtrain's) one chunk of 64 rows,
    above what the plan's estimate counts."""
    from dtrain.engine.head import mlx_logsumexp
    from dtrain.engine.kernels import logsumexp

    D, V, chunk = 32, 16384, 64
    head = linear_head(D, V)
    h = mx.random.normal((8 * chunk, D))
    targets = mx.random.randint(0, V, (8 * chunk,))
    mx.eval(h, targets)

    def peak(n, lse):
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(*token_logps(head, h[:n], targets[:n], chunk, logsumexp=lse))
        return mx.get_peak_memory() - base

    for lse in (mlx_logsumexp, logsumexp):
        one, many = peak(chunk, lse), peak(8 * chunk, lse)
        assert one >= 2 * chunk * V * 4  # the logits and their gradient
        assert many < 1.1 * one, (many / one)
