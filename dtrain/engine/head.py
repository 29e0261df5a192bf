"""The LM head in token chunks: target log-probabilities and their gradient
with respect to the final hidden rows, without a ``(T, V)`` logits array.

The head acts on each hidden row independently (final norm, output
projection, soft-capping, log-softmax, pick the target), so
``d logp_i / d h_j = 0`` for ``i != j`` and one vjp with a cotangent of ones
per chunk gives every row's Jacobian ``J_i = d logp_i / d h_i`` ``(D,)``.
The loss only sees the ``(N,)`` log-probabilities, so afterwards
``dL/dh_i = (dL/dlogp_i) * J_i``: no recompute of the head is needed.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from .loss import upcast


def _chunks(n: int, size: int):
    size = n if size <= 0 else size
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)


def mlx_logsumexp(x: mx.array) -> mx.array:
    """MLX's ``logsumexp`` over the last axis: ``(..., V) -> (...)``."""
    return mx.logsumexp(x, axis=-1)


def target_logps(head: Callable, targets: mx.array, logsumexp: Callable = mlx_logsumexp) -> Callable:
    """``f(h (n, D)) -> (n,)`` ``log softmax(head(h))[i, targets[i]]``, lazily
    (no evaluation inside, so it can sit in a function transformation); ``logsumexp``
    over the last axis (``arch.Arch.logsumexp``). In float32, or float64 for a float64
    model (``loss.upcast``, as the reference engine's ``gather_token_logps``)."""

    def f(h):  # (n, D) -> (n,)
        logits = upcast(head(h))  # (n, V)
        picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        return picked - logsumexp(logits)

    return f


def token_logps(head: Callable, h_rows: mx.array, targets: mx.array, chunk: int = 0, with_jacobian: bool = True,
                vjp_fn: Callable | None = None, logsumexp: Callable = mlx_logsumexp):
    """Log-probabilities of ``targets`` under the head, chunk by chunk.

    Args:
        head: ``(n, D) -> (n, V)`` logits (see ``arch.Arch.head``).
        h_rows: ``(N, D)`` final hidden rows (before the final norm), evaluated.
        targets: ``(N,)`` int32 target ids.
        chunk: rows per chunk; 0 = all rows at once.
        with_jacobian: also return ``J`` ``(N, D)``, ``J[i] = d logp_i / d h_rows[i]``.
        vjp_fn: ``(h_c (n, D), targets_c (n,)) -> (logps, J)`` for a chunk (e.g. a
            compiled one); default: ``mx.vjp`` of :func:`target_logps`.
        logsumexp: as in :func:`target_logps`.
    Returns:
        ``(logps (N,), J (N, D) or None)``, evaluated chunk by chunk: at most a
        ``(chunk, V)`` logits array (and its gradient) exists at any time.
    """
    logps, jac = [], []
    for lo, hi in _chunks(h_rows.shape[0], chunk):
        h_c, t_c = h_rows[lo:hi], targets[lo:hi]  # (n, D), (n,)
        if with_jacobian:
            if vjp_fn is None:
                (lp,), (j,) = mx.vjp(target_logps(head, t_c, logsumexp), [h_c], [mx.ones((hi - lo,), mx.float32)])
            else:
                lp, j = vjp_fn(h_c, t_c)
            # done before the next chunk starts: only scheduled (mx.async_eval), a chunk's
            # (n, V) arrays were still alive while the next one's were made (twice the peak)
            mx.eval(lp, j)
            jac.append(j)
        else:
            lp = target_logps(head, t_c, logsumexp)(h_c)
            mx.eval(lp)
        logps.append(lp)
    cat = lambda xs: xs[0] if len(xs) == 1 else mx.concatenate(xs)  # noqa: E731
    return cat(logps), (cat(jac) if with_jacobian else None)


def hidden_grad(dl_dlogp: mx.array, jac: mx.array, rows: mx.array, n_rows: int) -> mx.array:
    """Scatter the per-target gradients back onto the hidden rows.

    Args:
        dl_dlogp: ``(N,)`` dL/dlogp per target.
        jac: ``(N, D)`` row Jacobians from :func:`token_logps`.
        rows: ``(N,)`` int32 flat row index of each target (a row may repeat:
            under prefix sharing the last prompt row predicts two tokens).
        n_rows: ``S * L``.
    Returns:
        ``(n_rows, D)`` dL/dh.
    """
    g = dl_dlogp[:, None].astype(jac.dtype) * jac  # (N, D)
    return mx.zeros((n_rows, jac.shape[1]), jac.dtype).at[rows].add(g)
