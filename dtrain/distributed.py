"""The only module that talks to ``mx.distributed``.

Everything else receives a :class:`Group` and calls its methods; at world size
1 every method returns its input unchanged (the same code path, no setup).

Every collective runs inside a :class:`Watchdog`: MLX collectives are lazy and
block in ``mx.eval``, and the ring backend can wait forever for a peer that
stalled, so each method evaluates its result while a timer is armed. When the
timer fires, the rank prints which collective at which step did not complete
and exits with :data:`EXIT_TIMEOUT`; a peer that died outright usually makes
MLX raise at once, which becomes a one-line :class:`CollectiveError` (exit status 4).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .errors import UserError
from .memory import is_out_of_memory
from .contract import (BACKENDS, ERROR_PREFIX, EXIT_AFTER_RANK0, EXIT_LOST_PEER, EXIT_TIMEOUT, JOB_VAR,  # the launcher contract
                       RANK_VARS, SIZE_VARS, STOP_SIGNALS, launcher_backend, rank_from_env, size_from_env)

BUCKET_BYTES = 32 * 1024 * 1024  # at most 32 MiB per all_sum call


class CollectiveError(UserError):
    """A collective failed because MLX lost a peer: the rank exits with ``EXIT_LOST_PEER``,
    which ``./launch --max-restarts`` treats as transient (unlike other user errors)."""

    exit_status = EXIT_LOST_PEER


class AfterRank0Error(UserError):
    """Rank 0 met a user error and shows it; another rank ends with ``EXIT_AFTER_RANK0`` and points to it
    (``rank 0 could not ...; see its message``), so the launcher blames rank 0 whichever report comes first."""

    exit_status = EXIT_AFTER_RANK0


class ForeignRankError(UserError):
    """Ranks of two different jobs joined one group (they were given the same ports): exit status
    ``EXIT_LOST_PEER`` too, since a restart (with other ports) can succeed."""

    exit_status = EXIT_LOST_PEER


class Watchdog:
    """Context manager that ends the process when its block outlives ``timeout_s``.

    A ``threading.Timer`` runs beside the block; MLX releases the GIL while it
    waits in ``mx.eval``, so the timer fires even inside a wedged collective.
    On firing it writes one line to stderr and calls ``os._exit(EXIT_TIMEOUT)``
    (no clean-up: the main thread is stuck in native code). A ``RuntimeError``
    from MLX inside the block (e.g. ``[ring] connection to a peer was lost``)
    becomes a :class:`CollectiveError` naming the collective and the step; MLX's out-of-memory
    error (:func:`dtrain.memory.is_out_of_memory`) is left as it is.

    Args:
        rank: this process's rank, for the message.
        what: the collective, e.g. ``"all_sum of LoRA gradients"``.
        step: the optimizer step, or None before training ("at start-up").
        timeout_s: seconds; ``<= 0`` disables the timer.
    """

    def __init__(self, rank: int, what: str, step: Optional[int], timeout_s: float):
        self.rank, self.what, self.step, self.timeout_s = rank, what, step, timeout_s
        self._timer: Optional[threading.Timer] = None

    @property
    def where(self) -> str:
        return "at start-up" if self.step is None else f"at step {self.step}"

    def message(self) -> str:
        return (f"{ERROR_PREFIX}rank {self.rank}: {self.what} {self.where} did not complete within "
                f"{self.timeout_s:g} s (distributed.collective_timeout_s); a peer rank died or stalled")

    def _fire(self) -> None:
        sys.stderr.write(self.message() + "\n")
        sys.stderr.flush()
        os._exit(EXIT_TIMEOUT)

    def __enter__(self) -> "Watchdog":
        if self.timeout_s > 0:  # a longer wait than a thread can (about 292 years) raised in the timer's thread
            self._timer = threading.Timer(min(self.timeout_s, threading.TIMEOUT_MAX), self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()  # returns at once after cancel(); leaves no thread behind
        # out of memory (the collective's buffers) is this rank's own failure, for the trainer to report
        if exc_type is not None and issubclass(exc_type, RuntimeError) and not is_out_of_memory(exc):
            raise CollectiveError(f"rank {self.rank}: {self.what} {self.where} failed: {exc}") from None
        return False


def bucket_bounds(n_elements: int, itemsize: int = 4, bucket_bytes: int = BUCKET_BYTES) -> list[tuple[int, int]]:
    """``[start, stop)`` element ranges of consecutive flat buckets of at most ``bucket_bytes``.

    Raises:
        ValueError: a bucket smaller than one element.
    """
    per = bucket_bytes // itemsize
    if per < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} holds no element of {itemsize} bytes")
    return [(i, min(i + per, n_elements)) for i in range(0, n_elements, per)]


@dataclass(frozen=True)
class Group:
    """A process group: ``rank`` in ``[0, size)`` and the MLX group (None at size 1).

    ``timeout_s`` arms a :class:`Watchdog` around each collective (0 = off);
    the trainer sets it from ``distributed.collective_timeout_s``. ``job``: the
    identity ``./launch`` gave this attempt's ranks (``DTRAIN_JOB``; empty when
    started otherwise), compared first in :func:`handshake`.
    """

    rank: int = 0
    size: int = 1
    backend: str = "none"
    mlx_group: Any = None
    timeout_s: float = 0.0
    job: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def watch(self, what: str, step: Optional[int]) -> Watchdog:
        return Watchdog(self.rank, what, step, self.timeout_s)

    def all_sum(self, tree: dict, scalars: Mapping[str, float], step: Optional[int],
                what: str = "all_sum of LoRA gradients", bucket_bytes: int = BUCKET_BYTES) -> tuple[dict, dict]:
        """Sum a tree of arrays and a dict of scalars over all ranks, in one collective.

        The leaves, then the scalars (by sorted name), are flattened into one
        float32 vector, summed in consecutive slices of at most ``bucket_bytes``
        (one ``mx.distributed.all_sum`` per slice; a large leaf spans several)
        and split back: a step's gradients, metric sums and stop flag cost one
        round trip. Returns ``(tree, scalars)``: the tree evaluated, each leaf in
        its shape and dtype (at world size 1 the tree given); the scalars as
        Python floats, rounded to float32 at every world size.

        Raises:
            CollectiveError: MLX reported a lost peer during the collective.
        """
        keys = sorted(scalars)
        vec = mx.array([float(scalars[k]) for k in keys], dtype=mx.float32)  # (len(scalars),)
        if self.size == 1:
            return tree, dict(zip(keys, vec.tolist()))
        leaves = tree_flatten(tree)
        flat = mx.concatenate([v.astype(mx.float32).reshape(-1) for _, v in leaves] + [vec])  # (sum of sizes,)
        bounds = bucket_bounds(flat.size, 4, bucket_bytes)
        with self.watch(f"{what} ({len(bounds)} bucket(s))" if leaves else what, step):
            parts = [mx.distributed.all_sum(flat[a:b], group=self.mlx_group) for a, b in bounds]
            mx.eval(parts)
        summed = mx.concatenate(parts) if len(parts) > 1 else parts[0] if parts else flat  # nothing to sum: no buckets
        out, start = [], 0
        for name, value in leaves:
            out.append((name, summed[start : start + value.size].reshape(value.shape).astype(value.dtype)))
            start += value.size
        out = tree_unflatten(out) if leaves else tree
        mx.eval(out)
        return out, dict(zip(keys, summed[start:].tolist()))

    def all_sum_tree(self, tree: dict, step: Optional[int], what: str = "all_sum of LoRA gradients",
                     bucket_bytes: int = BUCKET_BYTES) -> dict:
        """:meth:`all_sum` of a tree alone."""
        return self.all_sum(tree, {}, step, what, bucket_bytes)[0]

    def all_sum_scalars(self, values: Mapping[str, float], step: Optional[int], what: str = "all_sum of metrics") -> dict:
        """:meth:`all_sum` of scalars alone; returns floats."""
        return self.all_sum({}, values, step, what)[1]

    def all_gather_text(self, text: str, step: Optional[int], what: str = "all_gather of text") -> list[str]:
        """Every rank's ``text`` (UTF-8, any length), in rank order."""
        if self.size == 1:
            return [text]
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        # mx.eval before np.array: np.array of an unevaluated collective drops MLX's lost-peer error
        # and returns whatever the buffer held (MLX 0.32 ring: a dead rank's text read as '')
        with self.watch(what, step):
            n = mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32), group=self.mlx_group)
            mx.eval(n)
            lengths = np.array(n)  # (size,)
            padded = np.zeros(int(lengths.max()), np.int32)
            padded[: data.size] = data
            got = mx.distributed.all_gather(mx.array(padded), group=self.mlx_group)
            mx.eval(got)
            got = np.array(got)
        got = got.reshape(self.size, -1)
        return [bytes(got[r, : int(lengths[r])].astype(np.uint8)).decode("utf-8") for r in range(self.size)]


    def broadcast_text(self, text: str, step: Optional[int], what: str = "broadcast of text") -> str:
        """Rank 0's ``text`` on every rank (other ranks' ``text`` is ignored)."""
        if self.size == 1:
            return text
        return self.all_gather_text(text if self.is_main else "", step, what)[0]

    def broadcast_arrays(self, arrays: Mapping[str, mx.array], step: Optional[int],
                         what: str = "broadcast of arrays") -> dict:
        """Rank 0's arrays on every rank, bit for bit, each in its own dtype.

        Every rank passes arrays of the same names, shapes and dtypes; only
        rank 0's values matter. MLX has no broadcast, so this is an
        ``all_sum`` in which the other ranks contribute ``-0.0`` (integers: 0):
        ``x + (-0.0) == x`` for every IEEE float ``x``, signed zeros and NaN
        included, so the sum is rank 0's value exactly. Names are taken in
        sorted order; one flat collective per dtype and bucket, as in
        :meth:`all_sum_tree`.

        Returns:
            ``{name: array}``, evaluated.
        Raises:
            CollectiveError: MLX reported a lost peer during the collective.
        """
        if self.size == 1:
            return dict(arrays)
        out = {}
        for dtype in sorted({v.dtype for v in arrays.values()}, key=str):
            names = sorted(k for k, v in arrays.items() if v.dtype == dtype)
            zero = -0.0 if mx.issubdtype(dtype, mx.floating) else 0
            mine = [arrays[k].reshape(-1) if self.is_main else mx.full((arrays[k].size,), zero, dtype=dtype)
                    for k in names]
            flat = mx.concatenate(mine) if len(mine) > 1 else mine[0]
            bounds = bucket_bounds(flat.size, dtype.size)
            with self.watch(f"{what} ({len(bounds)} bucket(s) of {dtype})", step):
                parts = [mx.distributed.all_sum(flat[a:b], group=self.mlx_group) for a, b in bounds]
                mx.eval(parts)
            summed = mx.concatenate(parts) if len(parts) > 1 else parts[0]
            start = 0
            for k in names:
                out[k] = summed[start : start + arrays[k].size].reshape(arrays[k].shape)
                start += arrays[k].size
        mx.eval(out)
        return out


def main_rank_check(group: Group, check, what: str, step: Optional[int] = None):
    """Run ``check`` on rank 0 and return its result there (None elsewhere), every rank waiting for it; every rank
    raises when it failed (``what`` it did, for the other ranks' message; ``step``: the step it happens after,
    None at start-up, for the watchdog's message)."""
    message, value = "", None
    if group.is_main:
        try:
            value = check()
        except UserError as err:
            message = str(err)
    failed = group.all_sum_scalars({"failed": float(bool(message))}, step, f"all_sum after rank 0's attempt to {what}")["failed"] > 0
    if message:
        raise UserError(message)
    if failed:
        raise AfterRank0Error(f"rank 0 could not {what}; see its message")
    return value


def init_group(backend: str = "any", timeout_s: float = 0.0, env: Optional[Mapping[str, str]] = None) -> Group:
    """Join the process group the launcher set up, or a group of one.

    With ``backend="any"`` the backend is read from the launcher's environment
    (:func:`launcher_backend`) rather than left to MLX's own order, which would
    try MPI first and could hand every ring rank a separate group of one.
    Without a launcher (and ``any``) no distributed setup happens at all.

    Args:
        backend: ``any | ring | jaccl | mpi | nccl``, or ``none`` for world size 1.
        timeout_s: watchdog for ``mx.distributed.init`` itself (0 = off).
        env: the environment to read (default ``os.environ``).
    Raises:
        UserError: the backend is not in this MLX or could not start, the group's size differs
            from the world size the launcher announced, or the environment
            names a rank >= 1 or a world size > 1 but no group of several ranks was formed.
    """
    env = os.environ if env is None else env
    found, expected = launcher_backend(env)
    expected = _announced_size(env, expected)
    rank = rank_from_env(env)
    if backend == "none" or (backend == "any" and found is None):
        _refuse_lone_rank(rank, env, "no launcher variables name the other ranks" if backend == "any"
                          else "distributed.backend is none")
        return Group()
    name = found if backend == "any" else backend
    if not mx.distributed.is_available(name):  # else init's error reads as a lost peer (exit 4, restarted)
        have = f"{', '.join(b for b in BACKENDS if mx.distributed.is_available(b)) or 'none'} (dtrain doctor lists them)"
        if name == "jaccl":  # MLX builds it for macOS 26.2+ only, where it loads librdma.dylib (mlx/distributed/jaccl)
            raise UserError(f"distributed backend 'jaccl' is not available to MLX {mx.__version__} here: MLX's JACCL "
                            f"(RDMA over Thunderbolt 5) needs macOS 26.2 or later with RDMA enabled (once, in macOS "
                            f"Recovery: rdma_ctl enable) and an MLX built for macOS 26.2 or later; this MLX has: "
                            f"{have}; the ring backend runs over Thunderbolt too (--backend ring, with the Macs' "
                            f"Thunderbolt Bridge IPs)")
        libmpi = "; MPI's also needs a libmpi MLX can load (./launch sets MLX_MPI_LIBNAME)" if name == "mpi" else ""
        raise UserError(f"distributed backend '{name}' is not in this MLX {mx.__version__}; it has: {have}{libmpi}")
    if found is None and name in ("ring", "jaccl", "nccl"):  # MLX reads their peers from the launcher's variables
        raise UserError(f"distributed.backend is {name}, but no launcher started this process (its environment "
                        f"names no other ranks); start the ranks with ./launch -n N or ./launch --hostfile HOSTS.json, "
                        f"or set distributed.backend any to train alone")
    try:
        with Watchdog(rank, f"joining the '{name}' group", None, timeout_s), _stops_kill():
            g = mx.distributed.init(strict=True, backend=name)
    except ValueError as err:  # an unknown backend name; RuntimeError becomes UserError above
        raise UserError(f"distributed backend '{name}' could not start: {err}") from None
    if expected > 1 and g.size() != expected:
        raise UserError(f"distributed backend '{name}' formed a group of {g.size()} rank(s); the launcher announced "
                        f"{expected} ({_size_source(env)})")
    if g.size() == 1:
        _refuse_lone_rank(rank, env, f"the '{name}' backend formed a group of one")
        return Group(timeout_s=timeout_s)
    return Group(rank=g.rank(), size=g.size(), backend=name, mlx_group=g, timeout_s=timeout_s, job=env.get(JOB_VAR, ""))


@contextlib.contextmanager
def _stops_kill():
    """The stop signals' default action (end the process) while the block runs, where Python's handlers were
    set: MLX's ring init retries a peer that is not there for about 30 s, holding the GIL, and a handler would
    run only after it, though a stop that ended the peer in its start-up means it never comes. Nothing is
    trained or written while joining; an ignored signal stays ignored."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only
        yield
        return
    kept = {}
    try:
        for sig in STOP_SIGNALS:
            if callable(handler := signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)  # runs a handler pending since before: a stop just before raises
                kept[sig] = handler
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


def _announced_size(env: Mapping[str, str], from_backend: int) -> int:
    """The world size the launcher announced: the backend's own (e.g. the ring hostfile's length) or a
    size variable (:data:`SIZE_VARS`); 0 when none says.

    Raises:
        UserError: a size variable is not a whole number, or two announcements disagree (e.g.
            ``MLX_WORLD_SIZE=3`` with a 2-rank ring hostfile).
    """
    sizes = {k: size_from_env(env, k) for k in SIZE_VARS if env.get(k)}
    size = next(iter(sizes.values()), 0)
    if from_backend > 1 and size and size != from_backend:
        raise UserError(f"{_size_source(env)}, but the launcher's other variables name {from_backend} ranks "
                        "(e.g. the ring's MLX_HOSTFILE); start every rank with ./launch or mlx.launch")
    return from_backend if from_backend > 1 else size


def _size_source(env: Mapping[str, str]) -> str:
    var = next((k for k in SIZE_VARS if env.get(k, "").isdigit()), None)
    return f"{var}={env[var]}" if var else "the number of ranks in its variables"


def _refuse_lone_rank(rank: int, env: Mapping[str, str], why: str) -> None:
    """A process told it is rank >= 1, or one of several, must not train alone as rank 0 (it would
    write rank 0's files, or train on a fraction of the batch while its launcher waits for the others)."""
    if rank >= 1:
        var = next(k for k in RANK_VARS if env.get(k))
        raise UserError(f"{var}={env[var]} says this process is rank {rank}, but it joined no group ({why}); "
                        f"start every rank with ./launch or mlx.launch, or unset {var} to train alone")
    size = _announced_size(env, 1)
    if size > 1:
        var = next(k for k in SIZE_VARS if env.get(k, "").isdigit())
        raise UserError(f"{var}={env[var]} says this job has {size} ranks, but this process joined no group ({why}); "
                        f"start every rank with ./launch or mlx.launch, or unset {var} to train alone")


def fingerprint(obj: Any) -> str:
    """A short sha256 of a JSON-able object (for the start-up handshake)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _odd_ranks(values: list) -> list[int]:
    return [r for r, v in enumerate(values) if v != values[0]]


def _dotted(tree: dict, prefix: str = "") -> dict:
    """``{"section.key": value}`` of a nested dict (the resolved config)."""
    out = {}
    for k, v in tree.items():
        out.update(_dotted(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k: v})
    return out


def handshake(group: Group, facts: dict) -> None:
    """Stop every rank when the ranks belong to different jobs, or disagree on any of ``facts``.

    Args:
        facts: name -> JSON-able value (resolved config, data identity (the token ids),
            model identity, LoRA shapes, the initial adapter's weights).
    Raises:
        ForeignRankError: ranks of different jobs (``Group.job``) met, on every rank.
        UserError: on every rank, naming each fact that differs and the ranks; for the config,
            its keys that differ (the same YAML file resolves ``auto`` values per machine).
    """
    if group.size == 1:
        return
    config = facts.get("config")
    keyed = {k: fingerprint(v) for k, v in _dotted(config).items()} if isinstance(config, dict) else {}
    mine = {"job": group.job, "facts": {k: fingerprint(v) for k, v in facts.items()}, "config": keyed}
    gathered = [json.loads(t) for t in group.all_gather_text(json.dumps(mine, sort_keys=True), None, "start-up handshake")]
    jobs = [g["job"] for g in gathered]
    odd = _odd_ranks(jobs)
    if odd:
        raise ForeignRankError(
            f"rank(s) {', '.join(map(str, odd))} belong to another job (job {jobs[odd[0]] or '(none)'}; rank 0's is "
            f"{jobs[0] or '(none)'}): two jobs were given the same ports; give each its own --port (./launch -n N "
            "without --port takes free ones on its machine, but cannot check the ports of other machines: every "
            "--hostfile job starts at the same default port)")
    everyone, configs = [g["facts"] for g in gathered], [g["config"] for g in gathered]
    problems = []
    for key in sorted(set().union(*everyone)):
        odd = _odd_ranks([e.get(key) for e in everyone])
        if odd:
            keys = [k for k in sorted(set().union(*configs))
                    if any(configs[r].get(k) != configs[0].get(k) for r in odd)] if key == "config" else []
            problems.append(f"{key} differs on rank(s) {', '.join(map(str, odd))} from rank 0"
                            + (f" ({', '.join(keys)})" if keys else ""))
    if problems:
        raise UserError("ranks disagree before training: " + "; ".join(problems))


def weights_checksum(tree: dict) -> float:
    """A float64 checksum of the LoRA weights (position-weighted sum), for drift checks."""
    total = 0.0
    for i, (_, v) in enumerate(tree_flatten(tree)):
        total += float(np.array(v.astype(mx.float32), dtype=np.float64).sum()) * (i + 1)
    return total


def check_in_sync(group: Group, tree: dict, step: int) -> None:
    """Compare the LoRA weight checksum across ranks after ``step``.

    Raises:
        UserError: on every rank, when the ranks' LoRA weights drifted apart.
    """
    if group.size == 1:
        return
    values = group.all_gather_text(repr(weights_checksum(tree)), step, "LoRA weight sync check")
    odd = _odd_ranks(values)
    if odd:
        raise UserError(f"step {step}: LoRA weights on rank(s) {', '.join(map(str, odd))} differ from rank 0 "
                        f"(checksums {', '.join(values)}); the ranks drifted apart")
