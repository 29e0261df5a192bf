"""dtrain's own softmax, sigmoid, log-sum-exp and causal attention (``engine.kernels: dtrain``).

MLX's CPU backend evaluates ``exp`` (and ``sigmoid``, ``softmax``,
``logsumexp``, which use it) several times slower than ``power`` of the same
arguments, and its attention on the CPU materialises every query-key score,
the masked half of a causal row included (docs/benchmarks.md, "CPU kernels").
These functions compute the same values from ops it runs fast: ``exp(x)`` as
``power(e, x)``, and causal attention as matmuls over query blocks, each block
against the keys up to its last query only. Their vjps are written out
(``mx.custom_function``) from the saved outputs, as MLX's own are, so the
backward pass evaluates no further exponential except log-sum-exp's softmax.
Results equal MLX's to float32 rounding (tests/test_kernels.py).
"""

from __future__ import annotations

import math

import mlx.core as mx

E = math.e  # a Python float: it takes the dtype of the array it meets
QUERY_BLOCK = 128  # queries per attention block: fewer scores above the diagonal, a few more calls


@mx.custom_function
def exp(x: mx.array) -> mx.array:
    """``e ** x`` elementwise through ``mx.power`` (``-inf`` -> 0)."""
    return mx.power(E, x)


@exp.vjp
def _exp_vjp(x, g, y):
    return (g * y,)  # power's own vjp would also take log(e)


@mx.custom_function
def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (rows of ``-inf`` keys allowed, not whole rows of them)."""
    e = exp(x - mx.stop_gradient(x.max(axis=-1, keepdims=True)))
    return e / e.sum(axis=-1, keepdims=True)


@softmax.vjp
def _softmax_vjp(x, g, y):
    return (y * (g - (g * y).sum(axis=-1, keepdims=True)),)


@mx.custom_function
def sigmoid(x: mx.array) -> mx.array:
    """``1 / (1 + e ** -x)`` elementwise."""
    return 1 / (1 + exp(-x))


@sigmoid.vjp
def _sigmoid_vjp(x, g, s):
    return (g * s * (1 - s),)


def logsumexp(x: mx.array) -> mx.array:
    """``log sum exp`` over the last axis: ``(..., V) -> (...)``, as ``mx.logsumexp(x, axis=-1)``.

    The forward's ``exp(x - max)`` and its row sums are kept for the backward pass, whose
    softmax is then one multiply instead of another exponential over ``(..., V)`` (the LM
    head's largest elementwise pass), at the memory of one more ``(..., V)`` array."""
    return _logsumexp_parts(x)[0]


@mx.custom_function
def _logsumexp_parts(x: mx.array):
    """``(log sum exp (...), exp(x - max) (..., V), its row sums (..., 1))``; only the first is
    differentiable (the others are for the vjp; nothing outside this module reads them)."""
    m = mx.stop_gradient(x.max(axis=-1, keepdims=True))
    e = exp(x - m)
    total = e.sum(axis=-1, keepdims=True)
    return (m + mx.log(total))[..., 0], e, total


@_logsumexp_parts.vjp
def _logsumexp_vjp(x, cotangents, outputs):
    g, e, total = cotangents[0], outputs[1], outputs[2]
    return (e * (g[..., None] / total),)  # g times the softmax of x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` (mlx-lm's ``activations.swiglu``) with :func:`sigmoid`."""
    return gate * sigmoid(gate) * x


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, block: int = QUERY_BLOCK) -> mx.array:
    """Causal scaled dot-product attention, ``mx.fast.scaled_dot_product_attention(...,
    mask="causal")``'s values, by query blocks.

    ``q`` ``(B, H, Lq, Dh)``, ``k``/``v`` ``(B, Hkv, Lk, Dh)`` with ``Lq <= Lk`` and ``H`` a
    multiple of ``Hkv`` (grouped queries); returns ``(B, H, Lq, Dh)``. As in MLX, the queries
    are the last ``Lq`` positions: query ``i`` sees keys ``j <= i + Lk - Lq``. Query block
    ``[lo, hi)`` attends over keys ``[0, Lk - Lq + hi)`` only, so about half of the scores a full
    causal product would compute above the diagonal are never formed. ``block <= 0``: one block.
    """
    B, H, L, Dh = q.shape
    n_kv, off = k.shape[1], k.shape[2] - L
    q = (q * scale).reshape(B, n_kv, H // n_kv, L, Dh)  # (B, Hkv, r, Lq, Dh)
    k, v = k[:, :, None], v[:, :, None]  # (B, Hkv, 1, Lk, Dh)
    block = L if block <= 0 else block
    outs = []
    for lo in range(0, L, block):
        hi = min(lo + block, L)
        s = q[:, :, :, lo:hi] @ k[:, :, :, : off + hi].swapaxes(-1, -2)  # (B, Hkv, r, hi - lo, off + hi)
        allowed = mx.arange(off + hi)[None, :] <= mx.arange(off + lo, off + hi)[:, None]
        s = mx.where(allowed, s, -math.inf)
        outs.append(softmax(s) @ v[:, :, :, : off + hi])  # (B, Hkv, r, hi - lo, Dh)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, H, L, Dh)
