"""The only module that talks to ``mx.distributed``.

Everything else receives a :class:`Group` and calls its methods; at world size
1 every method returns its input unchanged (the same code path, no setup).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .errors import UserError

BUCKET_BYTES = 32 * 1024 * 1024  # at most 32 MiB per all_sum call


@dataclass
class Group:
    """A process group: ``rank`` in ``[0, size)`` and the MLX group (None at size 1)."""

    rank: int = 0
    size: int = 1
    backend: str = "none"
    mlx_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum_tree(self, tree: dict) -> dict:
        """Sum a tree of arrays over all ranks, in flat float32 buckets.

        Arrays are flattened and concatenated into buckets of at most
        ``BUCKET_BYTES`` (one ``mx.distributed.all_sum`` per bucket, not per
        tensor) and split back. The result keeps each leaf's shape and dtype.
        """
        if self.size == 1:
            return tree
        leaves = tree_flatten(tree)
        out, bucket, used = [], [], 0
        for name, value in leaves:
            nbytes = value.size * 4
            if bucket and used + nbytes > BUCKET_BYTES:
                out.extend(self._reduce_bucket(bucket))
                bucket, used = [], 0
            bucket.append((name, value))
            used += nbytes
        if bucket:
            out.extend(self._reduce_bucket(bucket))
        return tree_unflatten(out)

    def _reduce_bucket(self, bucket: list) -> list:
        flat = mx.concatenate([v.astype(mx.float32).reshape(-1) for _, v in bucket])
        summed = mx.distributed.all_sum(flat, group=self.mlx_group)
        result, start = [], 0
        for name, value in bucket:
            n = value.size
            result.append((name, summed[start : start + n].reshape(value.shape).astype(value.dtype)))
            start += n
        return result

    def all_sum_scalars(self, values: dict) -> dict:
        """Sum a dict of scalars over all ranks in one collective; returns floats."""
        keys = sorted(values)
        vec = mx.array([float(values[k]) for k in keys], dtype=mx.float32)
        if self.size > 1:
            vec = mx.distributed.all_sum(vec, group=self.mlx_group)
        return dict(zip(keys, np.array(vec).tolist()))

    def all_gather_text(self, text: str) -> list[str]:
        """Every rank's ``text`` (UTF-8, any length), in rank order."""
        if self.size == 1:
            return [text]
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        n = mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32), group=self.mlx_group)
        longest = int(np.array(n).max())
        padded = np.zeros(longest, np.uint8)
        padded[: data.size] = data
        got = np.array(mx.distributed.all_gather(mx.array(padded.astype(np.int32)), group=self.mlx_group))
        got = got.reshape(self.size, longest)
        return [bytes(got[r, : int(np.array(n)[r])].astype(np.uint8)).decode("utf-8") for r in range(self.size)]


def init_group(backend: str = "any") -> Group:
    """Join the process group the launcher set up, or a group of one.

    Uses ``mx.distributed.init(backend=...)``; a process started without a
    launcher gets world size 1 with no setup at all.

    Raises:
        UserError: the backend was asked for explicitly but is not available.
    """
    if backend == "none":
        return Group()
    try:
        g = mx.distributed.init(strict=backend != "any", backend=backend)
    except Exception as err:  # MLX raises RuntimeError/ValueError with its own text
        raise UserError(f"distributed backend '{backend}' could not start: {err}") from None
    if g.size() == 1:
        return Group()
    return Group(rank=g.rank(), size=g.size(), backend=backend, mlx_group=g)


def fingerprint(obj: Any) -> str:
    """A short sha256 of a JSON-able object (for the start-up handshake)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def handshake(group: Group, facts: dict) -> None:
    """Stop every rank when the ranks disagree on any of ``facts``.

    Args:
        facts: name -> JSON-able value (resolved config, data fingerprint,
            model identity, LoRA shapes).
    Raises:
        UserError: on every rank, naming each fact that differs and the ranks.
    """
    if group.size == 1:
        return
    mine = {k: fingerprint(v) for k, v in facts.items()}
    everyone = [json.loads(t) for t in group.all_gather_text(json.dumps(mine, sort_keys=True))]
    problems = []
    for key in sorted(mine):
        seen = [e.get(key) for e in everyone]
        if len(set(seen)) > 1:
            odd = [r for r, v in enumerate(seen) if v != seen[0]]
            problems.append(f"{key} differs on rank(s) {', '.join(map(str, odd))} from rank 0")
    if problems:
        raise UserError("ranks disagree before training: " + "; ".join(problems))


def weights_checksum(tree: dict) -> float:
    """A float64 checksum of the LoRA weights, for cross-rank drift checks."""
    total = 0.0
    for i, (_, v) in enumerate(tree_flatten(tree)):
        total += float(np.array(v.astype(mx.float32), dtype=np.float64).sum()) * (i + 1)
    return total


def check_in_sync(group: Group, tree: dict, step: int) -> None:
    """Compare the weight checksum across ranks.

    Raises:
        UserError: the ranks' LoRA weights drifted apart.
    """
    if group.size == 1:
        return
    c = weights_checksum(tree)
    values = group.all_gather_text(repr(c))
    if len(set(values)) > 1:
        raise UserError(f"step {step}: LoRA weights differ between ranks (checksums {', '.join(values)})")


def optional_group(group: Optional[Group]) -> Group:
    return group if group is not None else Group()
