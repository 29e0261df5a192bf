"""Token layouts: how a micro-batch of pairs becomes model inputs and targets.

Two layouts produce the *same set* of predicted tokens, so every engine feeds
the same loss:

- two sequences per pair, ``[prompt; chosen]`` and ``[prompt; rejected]``, right
  padded, plain causal attention (what TRL and the paper do);
- prefix sharing, one sequence ``[prompt; chosen; rejected]`` per pair, where
  rejected positions cannot attend to chosen positions and restart their
  positions at the prompt length, so each token sees exactly the context and
  positions it would see alone. The first rejected token is predicted from the
  last prompt position. A pair whose two prompts differ falls back to two
  sequences inside the same layout (counted in ``fallback_pairs``).

Everything here is host-side numpy; arrays become ``mx.array`` at the end.

Length buckets: with ``bucket > 0`` the sequence length ``L`` and the target
count ``N`` are padded up to :func:`bucket_length`, so a run sees a few shapes
instead of one per pair. Padded tokens sit after every real token (causal
attention never shows them to a real query) and padded targets have zero
weights, so losses and gradients are those of the unpadded layout.

Packing (``pack=True``): every sequence of the micro-batch goes, one after the
other, into a single row (``S = 1``), padded only up to the bucket of the
total length, instead of each sequence being padded to the longest. Each
sequence keeps its own positions (from 0) and attends only within itself:
attention runs on rows gathered per sequence (:class:`SharedAttention`) or
under a mask that also separates sequences (:func:`attention_mask`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..types import TokenizedPair
from .objective import Totals

PAD = 0
# Block ids per token, used to build attention masks.
BLOCK_PAD, BLOCK_PROMPT, BLOCK_CHOSEN, BLOCK_REJECTED = -1, 0, 1, 2
BUCKETS_PER_OCTAVE = 8  # above 8 quanta, steps grow with the length: <= 12.5% padding


def bucket_length(n: int, quantum: int) -> int:
    """``n`` rounded up to a bucket: a multiple of ``quantum`` below ``16 * quantum``,
    then of ``quantum * 2**k`` for ``n`` in ``[8, 16) * quantum * 2**k``: each octave
    holds 8 buckets and the padding is under one quantum or under ``n / 8``.

    ``quantum <= 0`` returns ``n`` (exact shapes). 128 is what MLX's CUDA backend
    needs for its fused (cuDNN) attention backward: query lengths that are not
    a multiple of 128 fall back to materialising the scores.
    """
    if quantum <= 0 or n <= 0:
        return n
    step = quantum * 2 ** max(0, math.floor(math.log2(n / (BUCKETS_PER_OCTAVE * quantum))))
    return -(-n // step) * step


@dataclass
class Layout:
    """A micro-batch of ``B`` pairs laid out as ``S`` sequences of length ``L``.

    Attributes:
        tokens: ``(S, L)`` int32 input ids, padded with 0.
        positions: ``(S, L)`` int32 RoPE positions (block-wise under prefix sharing).
        blocks: ``(S, L)`` int8 block ids (prompt/chosen/rejected/pad) for masks.
        rows: ``(N,)`` int32 flat index into ``tokens.reshape(-1)`` of the hidden
            state that predicts each target token.
        targets: ``(N,)`` int32 target token ids.
        pair_of: ``(N,)`` int32 pair index in ``[0, B)``.
        w_nll, w_chosen, w_rejected: ``(N,)`` float32 0/1 role weights.
        chosen_len, rejected_len: ``(B,)`` float32 response token counts.
        n_pairs, nll_tokens, input_tokens, fallback_pairs: host-side counts.
        block_sparse: True when some sequence holds ``[prompt; chosen; rejected]``
            (its mask is not plain causal).
        spans: per sequence, host-side ``(P, C, R)`` token counts of its
            ``[prompt; chosen; rejected]`` blocks; ``R = 0`` for a two-sequence
            row ``[prompt; response]`` (``C`` is then the response).
        starts: per sequence, host-side flat index of its first token in
            ``tokens.reshape(-1)`` (``s * L`` unpacked; running offsets when packed).
        packed: the sequences share rows (``pack=True``): attention must keep them apart.
        bucket: the length quantum ``L`` and ``N`` were padded with (0 = none);
            attention plans pad their own lengths with it too.
        extra: the pairs' per-pair extra inputs (:func:`pair_extras`), name -> ``(B,)`` float32.
    """

    tokens: mx.array
    positions: mx.array
    blocks: mx.array
    rows: mx.array
    targets: mx.array
    pair_of: mx.array
    w_nll: mx.array
    w_chosen: mx.array
    w_rejected: mx.array
    chosen_len: mx.array
    rejected_len: mx.array
    n_pairs: int
    nll_tokens: int
    input_tokens: int
    fallback_pairs: int
    block_sparse: bool = False
    spans: tuple[tuple[int, int, int], ...] = ()
    starts: tuple[int, ...] = ()
    packed: bool = False
    bucket: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    @property
    def computed_tokens(self) -> int:
        """Tokens every layer computes, padding included: ``S * L`` (``input_tokens`` of them are real)."""
        S, L = self.shape
        return S * L


class _Builder:
    """Accumulates sequences and target rows; ``finish`` pads and converts."""

    def __init__(self, nll_scope: str):
        self.nll_scope = nll_scope
        self.seqs, self.pos, self.blk, self.spans = [], [], [], []
        self.targets = []  # (seq index, t, target id, pair, nll, chosen, rejected)
        self.block_sparse = False

    def add_sequence(self, tokens, positions, blocks, span) -> int:
        self.spans.append(span)
        self.seqs.append(tokens)
        self.pos.append(positions)
        self.blk.append(blocks)
        return len(self.seqs) - 1

    def add_targets(self, s, ts, ids, pair, nll, chosen, rejected):
        for t, i in zip(ts, ids):
            self.targets.append((s, t, i, pair, nll, chosen, rejected))

    def add_prompt_nll(self, s, prompt, pair) -> None:
        """Prompt tokens 1.. of sequence ``s`` (which starts with ``prompt``), NLL only."""
        k = nll_prompt_targets(len(prompt), self.nll_scope)
        self.add_targets(s, range(k), list(prompt)[1 : k + 1], pair, 1, 0, 0)

    def add_side(self, pair, prompt, response, chosen: bool) -> None:
        """One ``[prompt; response]`` sequence (two-sequence layout)."""
        P, R = len(prompt), len(response)
        seq = list(prompt) + list(response)
        blocks = [BLOCK_PROMPT] * P + [BLOCK_CHOSEN if chosen else BLOCK_REJECTED] * R
        s = self.add_sequence(seq, list(range(P + R)), blocks, (P, R, 0))
        if chosen:
            self.add_prompt_nll(s, prompt, pair)
        self.add_targets(s, range(P - 1, P + R - 1), response, pair, int(chosen), int(chosen), int(not chosen))

    def add_shared(self, pair, prompt, chosen, rejected) -> None:
        """One ``[prompt; chosen; rejected]`` sequence (prefix sharing)."""
        P, C, R = len(prompt), len(chosen), len(rejected)
        seq = list(prompt) + list(chosen) + list(rejected)
        pos = list(range(P + C)) + list(range(P, P + R))
        blocks = [BLOCK_PROMPT] * P + [BLOCK_CHOSEN] * C + [BLOCK_REJECTED] * R
        s = self.add_sequence(seq, pos, blocks, (P, C, R))
        self.block_sparse = True
        self.add_prompt_nll(s, prompt, pair)
        self.add_targets(s, range(P - 1, P + C - 1), chosen, pair, 1, 1, 0)
        # rejected[0] from the last prompt position, then from rejected positions
        self.add_targets(s, [P - 1] + list(range(P + C, P + C + R - 1)), rejected, pair, 0, 0, 1)

    def finish(self, pairs, fallback: int, bucket: int = 0, pack: bool = False) -> Layout:
        lengths = [len(x) for x in self.seqs]
        if pack:  # one row, the sequences back to back
            S, L = 1, bucket_length(sum(lengths), bucket)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        else:
            S, L = len(self.seqs), bucket_length(max(lengths), bucket)
            starts = np.arange(S, dtype=np.int64) * L
        tokens = np.full(S * L, PAD, np.int32)
        positions = np.zeros(S * L, np.int32)
        blocks = np.full(S * L, BLOCK_PAD, np.int8)
        for o, n, x, p, b in zip(starts, lengths, self.seqs, self.pos, self.blk):
            tokens[o : o + n], positions[o : o + n], blocks[o : o + n] = x, p, b
        t = np.array(self.targets, np.int64).reshape(-1, 7)
        pad = bucket_length(len(t), bucket) - len(t)  # zero-weight targets read token 0, pair 0
        t = np.concatenate([t, np.zeros((pad, 7), np.int64)])
        return Layout(
            tokens=mx.array(tokens.reshape(S, L)),
            positions=mx.array(positions.reshape(S, L)),
            blocks=mx.array(blocks.reshape(S, L)),
            rows=mx.array((starts[t[:, 0]] + t[:, 1]).astype(np.int32)),
            targets=mx.array(t[:, 2].astype(np.int32)),
            pair_of=mx.array(t[:, 3].astype(np.int32)),
            w_nll=mx.array(t[:, 4].astype(np.float32)),
            w_chosen=mx.array(t[:, 5].astype(np.float32)),
            w_rejected=mx.array(t[:, 6].astype(np.float32)),
            chosen_len=mx.array(np.array([len(p.chosen) for p in pairs], np.float32)),
            # at least 1: an SFT row's (empty) rejected mean is then 0, not 0/0
            rejected_len=mx.array(np.array([max(len(p.rejected), 1) for p in pairs], np.float32)),
            n_pairs=len(pairs),
            nll_tokens=int(t[:, 4].sum()),
            input_tokens=int(sum(lengths)),
            fallback_pairs=fallback,
            block_sparse=self.block_sparse,
            spans=tuple(self.spans),
            starts=tuple(int(o) for o in starts),
            packed=pack,
            bucket=bucket,
            extra=pair_extras(pairs),
        )


def pair_extras(pairs: list[TokenizedPair]) -> dict:
    """``TokenizedPair.extra`` of ``pairs`` as name -> ``(B,)`` float32 (empty when they carry none).

    Raises:
        ValueError: the pairs do not all carry the same names.
    """
    names = sorted(pairs[0].extra or {}) if pairs else []
    if any(sorted(p.extra or {}) != names for p in pairs):
        raise ValueError(f"pairs carry different extra inputs: {sorted({tuple(sorted(p.extra or {})) for p in pairs})}")
    return {k: mx.array(np.array([p.extra[k] for p in pairs], np.float32)) for k in names}


def nll_prompt_targets(prompt_len: int, nll_scope: str) -> int:
    """Prompt tokens predicted in the NLL term: every prompt token after the first
    (``full``), or none (``response``). With the chosen response tokens, which are
    always NLL targets, this is the one rule for the NLL token count (the layouts'
    ``w_nll`` and :func:`nll_tokens`, hence :func:`batch_totals`)."""
    return prompt_len - 1 if nll_scope == "full" else 0


def nll_tokens(pair: TokenizedPair, nll_scope: str) -> int:
    """NLL targets of one pair over ``[prompt; chosen]``: ``sum(w_nll)`` of its layout rows."""
    return nll_prompt_targets(len(pair.prompt), nll_scope) + len(pair.chosen)


def batch_totals(pairs: list[TokenizedPair], nll_scope: str) -> Totals:
    """The ``Totals`` of a global batch: its NLL targets (:func:`nll_tokens`, without building
    layouts) and its pairs; ``nll_scope`` is the objective's."""
    return Totals(nll_tokens=float(sum(nll_tokens(p, nll_scope) for p in pairs)), pairs=float(len(pairs)))


def _check(pairs: list[TokenizedPair]) -> None:
    if not pairs:
        raise ValueError("a micro-batch needs at least one pair")
    for p in pairs:  # an empty rejected side is an SFT row: its chosen sequence only
        if not p.prompt or not p.chosen:
            raise ValueError(f"pair {p.source or '?'} has an empty prompt or response")


def two_sequence_layout(pairs: list[TokenizedPair], nll_scope: str = "full", bucket: int = 0,
                        pack: bool = False) -> Layout:
    """Lay out each pair as two right-padded sequences (chosen row, rejected row).

    ``bucket``: pad ``L`` and the target count to :func:`bucket_length` (0 = exact);
    ``pack``: every sequence in one row (module doc), padded to the bucket of the total.

    A pair with an empty ``rejected`` (an SFT row) is its chosen sequence alone.

    Raises:
        ValueError: no pairs, or a pair with an empty prompt or chosen response.
    """
    _check(pairs)
    b = _Builder(nll_scope)
    for i, p in enumerate(pairs):
        b.add_side(i, p.prompt, p.chosen, chosen=True)
        if p.rejected:
            b.add_side(i, p.rejected_prompt if p.rejected_prompt is not None else p.prompt, p.rejected, chosen=False)
    return b.finish(pairs, fallback=0, bucket=bucket, pack=pack)


def shared_prefix_layout(pairs: list[TokenizedPair], nll_scope: str = "full", bucket: int = 0,
                         pack: bool = False) -> Layout:
    """Lay out each pair as one ``[prompt; chosen; rejected]`` sequence.

    Pairs with ``rejected_prompt`` set fall back to two sequences; a pair with an
    empty ``rejected`` (an SFT row) is ``[prompt; chosen]``. ``bucket`` and ``pack``
    as in :func:`two_sequence_layout`.

    Raises:
        ValueError: no pairs, or a pair with an empty prompt or chosen response.
    """
    _check(pairs)
    b = _Builder(nll_scope)
    fallback = 0
    for i, p in enumerate(pairs):
        if not p.rejected:  # an SFT row: [prompt; chosen]
            b.add_side(i, p.prompt, p.chosen, chosen=True)
        elif p.shared_prompt:
            b.add_shared(i, p.prompt, p.chosen, p.rejected)
        else:
            fallback += 1
            b.add_side(i, p.prompt, p.chosen, chosen=True)
            b.add_side(i, p.rejected_prompt, p.rejected, chosen=False)
    return b.finish(pairs, fallback=fallback, bucket=bucket, pack=pack)


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
    ``M**2``); only the prompt's attention is computed twice (its projections
    and MLP are not). Interpreted by ``arch.shared_attention``.

    Attributes:
        gathers: per group, ``(rows, M)`` int32 flat token index (the
            sequence's ``Layout.starts`` ``+ t``) of each attention row's
            tokens; padding repeats a real token of the sequence after the
            row's real tokens, so no real query sees it (rows added to round a
            group's row count up gather token 0 and are read by nothing).
        scatter: ``(S * L,)`` int32, for each token, the flat index of the
            attention output it takes in the groups' outputs laid end to end
            (group ``g``'s row ``r``, slot ``i``: ``offset_g + r * M_g + i``;
            padded tokens take any; nothing reads them).
        shapes: host-side ``(rows, M)`` of each group.
    """

    gathers: tuple
    scatter: mx.array
    shapes: tuple[tuple[int, int], ...]

    @property
    def rows(self) -> int:
        return sum(r for r, _ in self.shapes)

    @property
    def length(self) -> int:
        return max(m for _, m in self.shapes)


ATTENTION_GROUPS = 4  # the most fused attention calls a layer makes over the gathered rows
GROUP_SAVING = 0.1  # one more call must save this share of the attention work of one call fewer


def group_rows(lengths: list[int], bucket: int, max_groups: int = ATTENTION_GROUPS):
    """Attention rows grouped by length for :class:`SharedAttention`.

    The rows, longest first, are cut into runs, one call each (``M_g``: the
    group's longest row, bucketed with ``bucket``). For each number of calls
    up to ``max_groups`` the cut of least attention work ``sum(rows_g *
    M_g**2)`` is found; more calls are taken only where each call beyond the
    first saves ``GROUP_SAVING`` of the work (the least ``work * (1 -
    GROUP_SAVING) ** -(calls - 1)``), since each is one more call per layer.
    With ``bucket > 0`` and more than one call, a call's row count is rounded
    up to a power of two (the extra rows are computed and discarded), so a
    run sees a bounded set of ``(rows, M)`` shapes; one call keeps the exact
    row count (every row padded to the longest, as with ``max_groups`` 1).

    Returns:
        ``[(row indices, rows_g, M_g), ...]``: every index once, longest rows
        first; ``[]`` without rows.
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

    def cost(a, b):  # rows order[a:b] as one of several groups
        return width(b - a) * M[a] ** 2

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
    best[1][n] = n * M[0] ** 2  # one call: the exact row count
    g = min(range(1, G + 1), key=lambda k: (best[k][n] / (1 - GROUP_SAVING) ** (k - 1), k))
    if g == 1:
        return [(order, n, M[0])]
    bounds, j = [], n
    for k in range(g, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    return [([order[i] for i in range(a, b)], width(b - a), M[a]) for a, b in reversed(bounds)]


def shared_attention_plan(layout: Layout, groups: int = ATTENTION_GROUPS) -> SharedAttention:
    """The :class:`SharedAttention` of a prefix-shared or packed layout, in at most ``groups``
    calls (:func:`group_rows`); each group's ``M`` is bucketed with ``layout.bucket``."""
    S, L = layout.shape
    rows, first = [], []  # rows: (sequence start, token indices); first: each sequence's first row
    for o, (P, C, R) in zip(layout.starts, layout.spans):
        first.append(len(rows))
        rows.append((o, np.arange(P + C)))
        if R:
            rows.append((o, np.concatenate([np.arange(P), np.arange(P + C, P + C + R)])))
    slot = np.zeros(len(rows), np.int64)  # flat output index of each row's first slot
    gathers, shapes, offset = [], [], 0
    for members, width, M in group_rows([len(t) for _, t in rows], layout.bucket, groups):
        gather = np.zeros((width, M), np.int64)
        for r, i in enumerate(members):
            o, t = rows[i]
            gather[r] = o  # padding: the sequence's token 0, after every real query of the row
            gather[r, : len(t)] = o + t
            slot[i] = offset + r * M
        gathers.append(mx.array(gather.astype(np.int32)))
        shapes.append((width, M))
        offset += width * M
    scatter = np.zeros(S * L, np.int64)  # padded tokens: any output
    for o, row, (P, C, R) in zip(layout.starts, first, layout.spans):
        n = P + C
        scatter[o : o + n] = slot[row] + np.arange(n)
        if R:
            scatter[o + n : o + n + R] = slot[row + 1] + P + np.arange(R)  # rejected i sits at P + i in its row
    return SharedAttention(tuple(gathers), mx.array(scatter.astype(np.int32)), tuple(shapes))


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
