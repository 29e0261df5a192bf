"""Attention plans over a layout (``layout.Layout``): what ``arch.attention`` takes as its mask.

Plain causal layouts use MLX's fused ``mask="causal"``; prefix-shared or packed
layouts gather each sequence's ``[prompt; chosen]`` and ``[prompt; rejected]``
rows into a few batched causal calls over rows of similar length
(:class:`SharedAttention`, :func:`group_rows`); sliding-window layers get an
explicit boolean mask (:func:`attention_mask`). Host-side numpy; arrays become
``mx.array`` at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .layout import BLOCK_CHOSEN, BLOCK_PAD, BLOCK_REJECTED, Layout, bucket_length


def attention_mask(layout: Layout, window: int | None = None) -> mx.array:
    """Boolean attention mask ``(S, 1, L, L)``; True where a query may attend.

    Causal in sequence order, except that rejected queries never see chosen
    keys, nor any query a key of another sequence packed in its row; with
    ``window``, a query sees keys whose *logical* positions are less than
    ``window`` behind it (sliding-window layers, e.g. Gemma 3). Padded
    queries attend to themselves only, so no row is empty.
    """
    S, L = layout.shape
    idx = mx.arange(L)
    causal = idx[None, :] <= idx[:, None]  # (L, L) query x key
    bq = layout.blocks[:, :, None]
    bk = layout.blocks[:, None, :]
    allowed = causal[None] & ~((bq == BLOCK_REJECTED) & (bk == BLOCK_CHOSEN)) & (bk != BLOCK_PAD)
    if layout.packed:  # sequence index of each token: only keys of the query's own sequence
        seq = np.full(S * L, -1, np.int32)
        for i, (o, (P, C, R)) in enumerate(zip(layout.starts, layout.spans)):
            seq[o : o + P + C + R] = i
        seq = mx.array(seq.reshape(S, L))
        allowed = allowed & (seq[:, :, None] == seq[:, None, :])
    if window is not None:
        pq = layout.positions[:, :, None]
        pk = layout.positions[:, None, :]
        allowed = allowed & (pq - pk < window)
    allowed = allowed | mx.eye(L, dtype=mx.bool_)[None]
    return allowed[:, None]


@dataclass(frozen=True)
class SharedAttention:
    """Prefix-shared attention as a few batched fused causal calls, with no mask array.

    A sequence ``[prompt; chosen; rejected]`` with spans ``(P, C, R)`` becomes
    two attention rows gathered from its tokens: ``[prompt; chosen]`` and
    ``[prompt; rejected]``, each plain causal (the rejected tokens then see
    the prompt and earlier rejected tokens, at their own positions). A
    two-sequence row ``(P, C, 0)`` is one attention row. Rows of similar
    length go into one group (:func:`group_rows`), padded to the group's
    length ``M`` and run as one ``mask="causal"`` call, so short rows are not
    padded to the longest row of the micro-batch (attention work grows with
    ``M**2``). Nothing reads the prompt queries of a ``[prompt; rejected]``
    row (the ``[prompt; chosen]`` row gives the prompt's outputs), so each
    call starts at the first query any of its rows needs (``starts``): a
    call of rejected rows skips the prompt queries its rows share. The
    prompt's keys serve both rows. Interpreted by ``arch.shared_attention``.

    Attributes:
        gathers: per group, ``(rows, M)`` int32 flat token index (the
            sequence's ``Layout.starts`` ``+ t``) of each attention row's
            tokens; padding repeats a real token of the sequence after the
            row's real tokens, so no real query sees it (rows added to round a
            group's row count up gather token 0 and are read by nothing).
        scatter: ``(S * L,)`` int32, for each token, the flat index of the
            attention output it takes in the groups' outputs laid end to end
            (group ``g``'s row ``r``, slot ``i >= q0_g``: ``offset_g + r * (M_g -
            q0_g) + i - q0_g``, ``offset_g`` the outputs of the groups before;
            padded tokens take any; nothing reads them).
        shapes: host-side ``(rows, M)`` of each group.
        starts: per group, the first of its ``M`` query slots computed (the
            call's queries are slots ``[start, M)``, MLX's causal alignment for
            fewer queries than keys); the scatter reads no earlier slot.
    """

    gathers: tuple
    scatter: mx.array
    shapes: tuple[tuple[int, int], ...]
    starts: tuple[int, ...]


ATTENTION_GROUPS = 4  # the most fused attention calls a layer makes over the gathered rows
GROUP_SAVING = 0.1  # one more call must save this share of the attention work of one call fewer


def first_query(starts, members, bucket: int) -> int:
    """The first query slot a group computes: the least ``starts`` of its rows (0 without
    ``starts``), rounded down to a multiple of ``bucket`` (a bounded set of call shapes)."""
    q0 = min((int(starts[i]) for i in members), default=0) if starts is not None and len(starts) else 0
    return q0 - q0 % bucket if bucket > 0 else q0


def group_rows(lengths: list[int], bucket: int, max_groups: int = ATTENTION_GROUPS, starts=None):
    """Attention rows grouped by length for :class:`SharedAttention`.

    The rows, longest first, are cut into runs, one call each (``M_g``: the
    group's longest row, bucketed with ``bucket``; its queries start at
    :func:`first_query` of the rows' ``starts``, the first query each row
    needs, 0 when None). For each number of calls up to ``max_groups`` the
    cut of least attention work ``sum(rows_g * (M_g**2 - q0_g**2))`` (the
    causal scores of queries ``[q0_g, M_g)``) is found; more calls are
    taken only where each call beyond the first saves ``GROUP_SAVING`` of
    the work (the least ``work * (1 - GROUP_SAVING) ** -(calls - 1)``),
    since each is one more call per layer.
    With ``bucket > 0`` and more than one call, a call's row count is rounded
    up to a power of two (the extra rows are computed and discarded), so a
    run sees a bounded set of ``(rows, M)`` shapes; one call keeps the exact
    row count (every row padded to the longest, as with ``max_groups`` 1).

    Returns:
        ``[(row indices, rows_g, M_g, q0_g), ...]``: every index once, longest
        rows first; ``[]`` without rows.
    Raises:
        ValueError: ``max_groups`` < 1.
    """
    if max_groups < 1:
        raise ValueError(f"attention groups must be >= 1, got {max_groups}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    if n == 0:
        return []
    G = min(max_groups, n)
    width = (lambda k: k) if bucket <= 0 else (lambda k: 1 << (k - 1).bit_length())
    M = [bucket_length(lengths[i], bucket) for i in order]

    def work(rows, a, b):  # rows order[a:b] as one call of `rows` rows
        q0 = first_query(starts, order[a:b], bucket)
        return rows * (M[a] ** 2 - q0**2)

    def cost(a, b):  # rows order[a:b] as one of several groups
        return work(width(b - a), a, b)

    # best[g][j]: least work covering order[:j] with g groups; cut[g][j]: where the last group starts
    best = [[math.inf] * (n + 1) for _ in range(G + 1)]
    cut = [[0] * (n + 1) for _ in range(G + 1)]
    best[0][0] = 0
    for g in range(1, G + 1):
        for j in range(g, n + 1):
            for a in range(g - 1, j):
                c = best[g - 1][a] + cost(a, j)
                if c < best[g][j]:
                    best[g][j], cut[g][j] = c, a
    best[1][n] = work(n, 0, n)  # one call: the exact row count
    g = min(range(1, G + 1), key=lambda k: (best[k][n] / (1 - GROUP_SAVING) ** (k - 1), k))
    if g == 1:
        return [(order, n, M[0], first_query(starts, order, bucket))]
    bounds, j = [], n
    for k in range(g, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    return [(order[a:b], width(b - a), M[a], first_query(starts, order[a:b], bucket)) for a, b in reversed(bounds)]


def shared_attention_plan(layout: Layout, groups: int = ATTENTION_GROUPS) -> SharedAttention:
    """The :class:`SharedAttention` of a prefix-shared or packed layout, in at most ``groups``
    calls (:func:`group_rows`); each group's ``M`` is bucketed with ``layout.bucket``."""
    S, L = layout.shape
    rows = []  # (sequence start, token indices) of each attention row
    first = []  # each sequence's first row
    needs = []  # each row's first query whose output is read
    for o, (P, C, R) in zip(layout.starts, layout.spans):
        first.append(len(rows))
        rows.append((o, np.arange(P + C)))
        needs.append(0)
        if R:
            rows.append((o, np.concatenate([np.arange(P), np.arange(P + C, P + C + R)])))
            needs.append(P)  # the prompt's outputs come from the chosen row
    slot = np.zeros(len(rows), np.int64)  # flat output index of each row's slot 0 (computed or not)
    gathers, shapes, starts, offset = [], [], [], 0
    for members, width, M, q0 in group_rows([len(t) for _, t in rows], layout.bucket, groups, needs):
        gather = np.zeros((width, M), np.int64)
        for r, i in enumerate(members):
            o, t = rows[i]
            gather[r] = o  # padding: the sequence's token 0, after every real query of the row
            gather[r, : len(t)] = o + t
            slot[i] = offset + r * (M - q0) - q0
        gathers.append(mx.array(gather.astype(np.int32)))
        shapes.append((width, M))
        starts.append(q0)
        offset += width * (M - q0)
    scatter = np.zeros(S * L, np.int64)  # padded tokens: any output
    for o, row, (P, C, R) in zip(layout.starts, first, layout.spans):
        n = P + C
        scatter[o : o + n] = slot[row] + np.arange(n)
        if R:
            scatter[o + n : o + n + R] = slot[row + 1] + P + np.arange(R)  # rejected i sits at P + i in its row
    return SharedAttention(tuple(gathers), mx.array(scatter.astype(np.int32)), tuple(shapes), tuple(starts))


def attention_plan(layout: Layout, window: int | None = None, groups: int = ATTENTION_GROUPS):
    """What ``arch.attention`` takes as its mask for this layout and window.

    ``"causal"`` (MLX's fused causal mode) for plain causal unpacked layouts
    without a window — right padding is never attended by real queries; a
    :class:`SharedAttention` for prefix-shared or packed layouts without a window; the
    explicit ``(S, 1, L, L)`` boolean :func:`attention_mask` otherwise
    (sliding-window layers).
    """
    if window is not None:
        return attention_mask(layout, window)
    if not layout.block_sparse and not layout.packed:
        return "causal"
    return shared_attention_plan(layout, groups)
