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
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..types import TokenizedPair

PAD = 0
# Block ids per token, used to build attention masks.
BLOCK_PAD, BLOCK_PROMPT, BLOCK_CHOSEN, BLOCK_REJECTED = -1, 0, 1, 2


@dataclass
class Layout:
    """A micro-batch of ``B`` pairs laid out as ``S`` sequences of length ``L``.

    Attributes:
        tokens: ``(S, L)`` int32 input ids, padded with 0.
        positions: ``(S, L)`` int32 RoPE positions (block-wise under prefix sharing).
        blocks: ``(S, L)`` int8 block ids (prompt/chosen/rejected/pad) for masks.
        rows: ``(N,)`` int32 flat index ``s * L + t`` of the hidden state that
            predicts each target token.
        targets: ``(N,)`` int32 target token ids.
        pair_of: ``(N,)`` int32 pair index in ``[0, B)``.
        w_nll, w_chosen, w_rejected: ``(N,)`` float32 0/1 role weights.
        chosen_len, rejected_len: ``(B,)`` float32 response token counts.
        n_pairs, nll_tokens, input_tokens, fallback_pairs: host-side counts.
        block_sparse: True when some sequence holds ``[prompt; chosen; rejected]``
            (its mask is not plain causal).
        spans: per sequence, host-side ``(P, C, R)`` token counts of its
            ``[prompt; chosen; rejected]`` blocks; ``R = 0`` for a two-sequence
            row ``[prompt; response]`` (``C`` is then the response). Padding
            follows ``P + C + R``.
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

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)


class _Builder:
    """Accumulates sequences and target rows; ``finish`` pads and converts."""

    def __init__(self, nll_response_only: bool):
        self.nll_response_only = nll_response_only
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

    def add_side(self, pair, prompt, response, chosen: bool) -> None:
        """One ``[prompt; response]`` sequence (two-sequence layout)."""
        P, R = len(prompt), len(response)
        seq = list(prompt) + list(response)
        blocks = [BLOCK_PROMPT] * P + [BLOCK_CHOSEN if chosen else BLOCK_REJECTED] * R
        s = self.add_sequence(seq, list(range(P + R)), blocks, (P, R, 0))
        if chosen and not self.nll_response_only:
            self.add_targets(s, range(P - 1), seq[1:P], pair, 1, 0, 0)
        self.add_targets(s, range(P - 1, P + R - 1), response, pair, int(chosen), int(chosen), int(not chosen))

    def add_shared(self, pair, prompt, chosen, rejected) -> None:
        """One ``[prompt; chosen; rejected]`` sequence (prefix sharing)."""
        P, C, R = len(prompt), len(chosen), len(rejected)
        seq = list(prompt) + list(chosen) + list(rejected)
        pos = list(range(P + C)) + list(range(P, P + R))
        blocks = [BLOCK_PROMPT] * P + [BLOCK_CHOSEN] * C + [BLOCK_REJECTED] * R
        s = self.add_sequence(seq, pos, blocks, (P, C, R))
        self.block_sparse = True
        if not self.nll_response_only:
            self.add_targets(s, range(P - 1), seq[1:P], pair, 1, 0, 0)
        self.add_targets(s, range(P - 1, P + C - 1), chosen, pair, 1, 1, 0)
        # rejected[0] from the last prompt position, then from rejected positions
        self.add_targets(s, [P - 1] + list(range(P + C, P + C + R - 1)), rejected, pair, 0, 0, 1)

    def finish(self, pairs, fallback: int) -> Layout:
        S, L = len(self.seqs), max(len(x) for x in self.seqs)
        tokens = np.full((S, L), PAD, np.int32)
        positions = np.zeros((S, L), np.int32)
        blocks = np.full((S, L), BLOCK_PAD, np.int8)
        for s, (x, p, b) in enumerate(zip(self.seqs, self.pos, self.blk)):
            tokens[s, : len(x)], positions[s, : len(x)], blocks[s, : len(x)] = x, p, b
        t = np.array(self.targets, np.int64).reshape(-1, 7)
        return Layout(
            tokens=mx.array(tokens),
            positions=mx.array(positions),
            blocks=mx.array(blocks),
            rows=mx.array((t[:, 0] * L + t[:, 1]).astype(np.int32)),
            targets=mx.array(t[:, 2].astype(np.int32)),
            pair_of=mx.array(t[:, 3].astype(np.int32)),
            w_nll=mx.array(t[:, 4].astype(np.float32)),
            w_chosen=mx.array(t[:, 5].astype(np.float32)),
            w_rejected=mx.array(t[:, 6].astype(np.float32)),
            chosen_len=mx.array(np.array([len(p.chosen) for p in pairs], np.float32)),
            rejected_len=mx.array(np.array([len(p.rejected) for p in pairs], np.float32)),
            n_pairs=len(pairs),
            nll_tokens=int(t[:, 4].sum()),
            input_tokens=int(sum(len(x) for x in self.seqs)),
            fallback_pairs=fallback,
            block_sparse=self.block_sparse,
            spans=tuple(self.spans),
        )


def _check(pairs: list[TokenizedPair]) -> None:
    if not pairs:
        raise ValueError("a micro-batch needs at least one pair")
    for p in pairs:
        if not p.prompt or not p.chosen or not p.rejected:
            raise ValueError(f"pair {p.source or '?'} has an empty prompt or response")


def two_sequence_layout(pairs: list[TokenizedPair], nll_scope: str = "full") -> Layout:
    """Lay out each pair as two right-padded sequences (chosen row, rejected row).

    Raises:
        ValueError: no pairs, or a pair with an empty prompt or response.
    """
    _check(pairs)
    b = _Builder(nll_scope == "response")
    for i, p in enumerate(pairs):
        b.add_side(i, p.prompt, p.chosen, chosen=True)
        b.add_side(i, p.rejected_prompt if p.rejected_prompt is not None else p.prompt, p.rejected, chosen=False)
    return b.finish(pairs, fallback=0)


def shared_prefix_layout(pairs: list[TokenizedPair], nll_scope: str = "full") -> Layout:
    """Lay out each pair as one ``[prompt; chosen; rejected]`` sequence.

    Pairs with ``rejected_prompt`` set fall back to two sequences.

    Raises:
        ValueError: no pairs, or a pair with an empty prompt or response.
    """
    _check(pairs)
    b = _Builder(nll_scope == "response")
    fallback = 0
    for i, p in enumerate(pairs):
        if p.shared_prompt:
            b.add_shared(i, p.prompt, p.chosen, p.rejected)
        else:
            fallback += 1
            b.add_side(i, p.prompt, p.chosen, chosen=True)
            b.add_side(i, p.rejected_prompt, p.rejected, chosen=False)
    return b.finish(pairs, fallback=fallback)


def attention_mask(layout: Layout, window: int | None = None) -> mx.array:
    """Boolean attention mask ``(S, 1, L, L)``; True where a query may attend.

    Causal in sequence order, except that rejected queries never see chosen
    keys; with ``window``, a query sees keys whose *logical* positions are less
    than ``window`` behind it (sliding-window layers, e.g. Gemma 3). Padded
    queries attend to themselves only, so no row is empty.
    """
    S, L = layout.shape
    idx = mx.arange(L)
    causal = idx[None, :] <= idx[:, None]  # (L, L) query x key
    bq = layout.blocks[:, :, None]
    bk = layout.blocks[:, None, :]
    allowed = causal[None] & ~((bq == BLOCK_REJECTED) & (bk == BLOCK_CHOSEN)) & (bk != BLOCK_PAD)
    if window is not None:
        pq = layout.positions[:, :, None]
        pk = layout.positions[:, None, :]
        allowed = allowed & (pq - pk < window)
    allowed = allowed | mx.eye(L, dtype=mx.bool_)[None]
    return allowed[:, None]


@dataclass(frozen=True)
class SharedAttention:
    """Prefix-shared attention as fused causal calls, with no mask array.

    For a sequence with spans ``(P, C, R)``, the ``[prompt; chosen]`` queries
    attend causally to ``[prompt; chosen]`` keys and the rejected queries to
    ``[prompt keys; rejected keys]`` with MLX's ``mask="causal"``, which for
    fewer queries than keys aligns to the bottom right (query ``i`` sees keys
    ``<= i + Lk - Lq``). Interpreted by ``arch.attention``.

    Attributes:
        length: ``L``, the padded sequence length.
        spans: per sequence ``(P, C, R)`` as in ``Layout.spans``.
    """

    length: int
    spans: tuple[tuple[int, int, int], ...]


def attention_plan(layout: Layout, window: int | None = None):
    """What ``arch.attention`` takes as its mask for this layout and window.

    ``"causal"`` (MLX's fused causal mode) for plain causal layouts without a
    window — right padding is never attended by real queries; a
    :class:`SharedAttention` for prefix-shared layouts without a window; the
    explicit ``(S, 1, L, L)`` boolean :func:`attention_mask` otherwise
    (sliding-window layers).
    """
    if window is not None:
        return attention_mask(layout, window)
    if not layout.block_sparse:
        return "causal"
    return SharedAttention(layout.shape[1], layout.spans)
