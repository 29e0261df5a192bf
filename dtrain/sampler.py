"""Which pairs each rank trains on at each step: a pure function of the step.

The global stream of pair indices is the concatenation of one order per
epoch; step ``s`` (1-based) takes the next ``global_batch_pairs`` indices of
that stream, and rank ``r`` of ``W`` takes every ``W``-th of those starting at
``r``. So shards are disjoint and deterministic, every rank runs the same
number of steps (a rank may get fewer pairs, even none, when the batch does
not divide by the world size), and resuming at step ``s`` needs only ``s``.

Each epoch's order is a seeded permutation, with one repair: when a step
straddles an epoch boundary, the pairs of the new epoch that the step would
take are chosen among those *not* in the old epoch's tail (a stable
partition of the permutation). So every pair is used exactly once per epoch
and no pair appears twice within a step, whenever ``global_batch_pairs`` is at
most the number of pairs (larger batches are refused). The repair makes an
epoch's order depend on the previous epoch's tail; an epoch that starts on a
step boundary (every ``B / gcd(n, B)``-th) depends on nothing, so computing
any step costs at most ``B / gcd(n, B)`` permutations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .data.sources import mlx_valid
from .errors import UserError
from .types import example_noun


def epoch_permutation(n_pairs: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded permutation of ``n_pairs`` behind ``epoch`` (int64 indices), before the repair."""
    return np.random.default_rng([seed, epoch]).permutation(n_pairs)


def repaired(order: np.ndarray, tail: np.ndarray, head: int) -> np.ndarray:
    """``order`` with its first ``head`` entries drawn from pairs not in ``tail``.

    A stable partition: the first ``head`` entries of ``order`` that are not in
    ``tail`` come first, then every other entry in its original order.
    Example: ``order=[1, 0, 2, 3, 4]``, ``tail=[1]``, ``head=1`` -> ``[0, 1, 2, 3, 4]``.
    """
    if head == 0 or tail.size == 0:
        return order
    free = np.flatnonzero(~np.isin(order, tail))[:head]
    rest = np.ones(order.size, bool)
    rest[free] = False
    return np.concatenate([order[free], order[rest]])


@dataclass
class Sampler:
    """The global batch of every step, and the data position after it.

    Args:
        n_pairs: training pairs.
        global_batch_pairs: pairs per optimizer step across all ranks.
        seed: shuffle seed (``train.seed``).
    Raises:
        ValueError: no pairs, a batch < 1, or a batch larger than ``n_pairs``
            (the trainer reports it to the user with the config keys first).
    """

    n_pairs: int
    global_batch_pairs: int
    seed: int
    _orders: dict = field(default_factory=dict, repr=False)  # epoch -> order; the newest two are kept

    def __post_init__(self):
        n, b = self.n_pairs, self.global_batch_pairs
        if n < 1 or b < 1 or b > n:
            raise ValueError(f"need 1 <= global_batch_pairs <= pairs (global_batch_pairs={b}, pairs={n})")

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order of the training pairs in ``epoch`` (a permutation of ``range(n_pairs)``)."""
        if epoch not in self._orders:
            n, b = self.n_pairs, self.global_batch_pairs
            period = b // math.gcd(n, b)  # epoch e opens on a step boundary when e * n % b == 0
            e = epoch - epoch % period
            order = epoch_permutation(n, self.seed, e)
            if epoch % period and epoch - 1 in self._orders:  # continue from the cached epoch
                e, order = epoch - 1, self._orders[epoch - 1]
            while e < epoch:
                e += 1
                tail = e * n % b  # pairs of epoch e - 1 in the step that opens epoch e
                order = repaired(epoch_permutation(n, self.seed, e), order[n - tail :], b - tail)
            self._orders = {k: v for k, v in self._orders.items() if k == epoch - 1} | {epoch: order}
        return self._orders[epoch]

    def global_batch(self, step: int) -> list[tuple[int, int]]:
        """``(epoch, pair index)`` of the global batch of ``step`` (1-based), no pair twice.

        Raises:
            ValueError: ``step < 1``.
        """
        if step < 1:
            raise ValueError(f"steps count from 1 (got {step})")
        n, b = self.n_pairs, self.global_batch_pairs
        start = (step - 1) * b
        out = []
        for pos in range(start, start + b):
            epoch, i = divmod(pos, n)
            out.append((epoch, int(self.epoch_order(epoch)[i])))
        return out

    def take(self, step: int, items: list, rank: int, world_size: int, micro: int) -> tuple[list, list[list]]:
        """Step ``step``'s global batch of ``items`` and rank ``rank``'s share of it in
        micro-batches of ``micro`` (:func:`shard_batches`): all a step asks of the sampler."""
        batch = [items[i] for _, i in self.global_batch(step)]
        return batch, shard_batches(batch, rank, world_size, micro)

    def position(self, step: int) -> dict:
        """Where the pair stream stands after ``step``: epoch, cursor, seed, next step's pairs.

        ``next_pairs`` lets a resumed run check that its sampler continues
        exactly where the saved one stopped.
        """
        epoch, cursor = divmod(step * self.global_batch_pairs, self.n_pairs)
        return {"epoch": epoch, "cursor": cursor, "shuffle_seed": self.seed,
                "next_pairs": [i for _, i in self.global_batch(step + 1)]}


def global_batch(step: int, n_pairs: int, global_batch_pairs: int, seed: int) -> list[tuple[int, int]]:
    """``(epoch, pair index)`` of the global batch of ``step``: :meth:`Sampler.global_batch`.

    Raises:
        ValueError: ``step < 1``, no pairs, or ``global_batch_pairs > n_pairs``.
    """
    return Sampler(n_pairs, global_batch_pairs, seed).global_batch(step)


def rank_shard(items: list, rank: int, world_size: int) -> list:
    """Rank ``rank``'s share of ``items``: every ``world_size``-th, from ``rank``."""
    return items[rank::world_size]


def micro_batches(items: list, size: int) -> list[list]:
    """Consecutive chunks of at most ``size`` items."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def shard_batches(items: list, rank: int, world_size: int, micro: int) -> list[list]:
    """Rank ``rank``'s share of ``items`` (:func:`rank_shard`) in micro-batches of ``micro``."""
    return micro_batches(rank_shard(items, rank, world_size), micro)


def dealt_batches(items: list, rank: int, world_size: int, micro: int) -> list[list]:
    """Micro-batches of ``micro`` cut from the whole of ``items`` and dealt to ranks in turn: rank
    ``rank``'s are batches ``rank, rank + world_size, ...``. A pair lands in the same micro-batch at
    every world size (evaluation and DPO's reference pass: their values then agree bit for bit)."""
    return micro_batches(items, micro)[rank::world_size]


def for_run(cfg, train_pairs: list) -> Sampler:
    """The run's :class:`Sampler` (``cfg``: the run's ``Config``).

    Raises:
        UserError: no training pairs, or a global batch larger than them (a
            step would have to train a pair twice).
    """
    n, b = len(train_pairs), cfg.train.global_batch_pairs
    where, noun = cfg.data.train or "the demo data", example_noun(cfg.objective.kind)
    if n == 0:
        raise UserError(f"no training {noun}s left after loading and filtering {where}")
    if b > n:
        d = cfg.data  # held-out pairs of their own (data.valid, data.valid_split, valid.jsonl) took none of these
        own = d.valid is not None or d.valid_split is not None or (d.train is not None and mlx_valid(d.train))
        split = "" if own else f" (after the held-out split, data.valid_fraction={d.valid_fraction})"
        raise UserError(f"train.global_batch_pairs is {b} but {where} has {n} training {noun}(s){split}; a step would "
                        f"train a {noun} more than once: set train.global_batch_pairs to at most {n}, or add data")
    return Sampler(n, b, cfg.train.seed)
