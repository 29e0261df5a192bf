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
attention runs on rows gathered per sequence (``attention.SharedAttention``) or
under a mask that also separates sequences (``attention.attention_mask``).
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
