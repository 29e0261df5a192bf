"""Which pairs each rank trains on at each step: a pure function of the step.

The global stream of pair indices is the concatenation of one seeded
permutation per epoch; step ``s`` (1-based) takes the next
``global_batch_pairs`` indices of that stream, and rank ``r`` of ``W`` takes
every ``W``-th of those starting at ``r``. So shards are disjoint and
deterministic, every rank runs the same number of steps (a rank may get fewer
pairs, even none, when the batch does not divide by the world size), no pair
appears twice in a step, and resuming at step ``s`` needs only ``s``.
"""

from __future__ import annotations

import numpy as np


def epoch_permutation(n_pairs: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the ``n_pairs`` training pairs in ``epoch`` (int64 indices)."""
    return np.random.default_rng([seed, epoch]).permutation(n_pairs)


def global_batch(step: int, n_pairs: int, global_batch_pairs: int, seed: int) -> list[tuple[int, int]]:
    """``(epoch, pair index)`` of the global batch of ``step`` (1-based).

    When ``global_batch_pairs > n_pairs`` a batch spans several epochs, and a
    pair may then appear once per epoch within one step.

    Raises:
        ValueError: ``step < 1`` or no pairs.
    """
    if step < 1 or n_pairs < 1:
        raise ValueError(f"need step >= 1 and at least one pair (step={step}, pairs={n_pairs})")
    start = (step - 1) * global_batch_pairs
    out = []
    for pos in range(start, start + global_batch_pairs):
        epoch, i = divmod(pos, n_pairs)
        out.append((epoch, int(epoch_permutation(n_pairs, seed, epoch)[i])))
    return out


def rank_shard(items: list, rank: int, world_size: int) -> list:
    """Rank ``rank``'s share of ``items``: every ``world_size``-th, from ``rank``."""
    return items[rank::world_size]


def micro_batches(items: list, size: int) -> list[list]:
    """Consecutive chunks of at most ``size`` items."""
    return [items[i : i + size] for i in range(0, len(items), size)]
