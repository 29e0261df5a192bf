"""Device memory: the budget the ``auto`` engine plans within, and Metal's wired limit for a run.

One owner for "how much memory may a training step use": :func:`budget_bytes`
turns MLX's ``mx.device_info()`` into a byte budget per backend, and
:func:`wired_limit` keeps the weights resident on Metal while a run lasts, as
mlx-lm's trainer does (``mlx_lm.utils.maybe_set_recommended_wired_limit``).

``mx.device_info()`` keys at MLX 0.32 (``mlx/backend/*/device_info.cpp``):
Metal: ``device_name``, ``architecture``, ``max_buffer_length``,
``max_recommended_working_set_size``, ``memory_size`` (the Mac's whole RAM),
``resource_limit``; CUDA: ``device_name``, ``architecture``, ``uuid``,
``pci_bus_id``, ``compute_capability_major/minor``, ``free_memory``,
``total_memory``; CPU: ``device_name``, ``architecture``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .contract import local_ranks_from_env

GIB = 1024**3
CUDA_SHARE = 0.85  # of the GPU's total memory; ESTIMATE_MARGIN (engine/plan.py) was measured under it
CPU_SHARE = 0.5  # of RAM, or of a container's limit (a quarter made auto recompute what fits: docs/benchmarks.md, 2026-12-01)
# Lower-cased pieces of the errors MLX 0.32 raises when a device allocation fails: Metal's
# ("[metal::malloc] Attempting to allocate N bytes which is greater than the maximum allowed buffer
# size", "Insufficient Memory (...kIOGPUCommandBufferCallbackErrorOutOfMemory)"), CUDA's runtime calls
# ("cudaMallocAsync(...) failed: out of memory", "cudaGraphInstantiate(...) failed: out of memory") and
# the CPU allocator's ("[malloc] Unable to allocate N bytes").
OUT_OF_MEMORY = ("out of memory", "insufficient memory", "outofmemory", "unable to allocate",
                 "maximum allowed buffer size")
# a Linux container's memory limit, as its own cgroup namespace shows it: cgroup v2, then v1
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def backend() -> str:
    """What the default device runs on: ``"metal"``, ``"cuda"`` or ``"cpu"``."""
    if mx.default_device() != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "cpu"


def physical_memory() -> int:
    """The RAM this process may use in bytes: the machine's (:func:`machine_memory`), or its
    container's limit (:func:`cgroup_limit`) when lower; 0 when neither is known."""
    return min((b for b in (machine_memory(), cgroup_limit()) if b > 0), default=0)


def cgroup_limit() -> int:
    """This process's container memory limit in bytes (``docker run --memory``, a Kubernetes limit):
    :data:`CGROUP_LIMITS` (cgroup v2's, else v1's file); 0 when unset ("max") or absent.
    v1 writes "no limit" as a number above any RAM. A limit of an enclosing cgroup is not read."""
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() else 0
    return 0


def machine_memory() -> int:
    """This machine's RAM in bytes: ``sysconf``, else macOS's ``sysctl -n hw.memsize``, else MLX's
    ``memory_size`` (Metal), else 0.

    Some macOS Pythons lack the names ``SC_PAGE_SIZE``/``SC_PHYS_PAGES`` (ValueError), and some
    OS X releases define them but fail the call (EINVAL).
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    try:
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=10).stdout
        return int(out.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return int(mx.device_info().get("memory_size", 0))


def budget_bytes(kind: str, info: Mapping, in_use: int, ram: int, local_ranks: int = 1) -> float:
    """The memory (bytes) the auto plans may fill, weights included.

    Args:
        kind: ``metal | cuda | cpu`` (:func:`backend`).
        info: ``mx.device_info()`` of the default device.
        in_use: bytes MLX already holds that the plan does not count itself.
        ram: the RAM this process may use in bytes (:func:`physical_memory`; the CPU's budget, and a fallback).
        local_ranks: ranks of the job on this machine; on Metal and the CPU they share
            its memory, so each gets its share. CUDA ranks each have a GPU.
    Returns:
        Metal: ``max_recommended_working_set_size`` / ``local_ranks`` less
        ``in_use`` (the most Metal advises a process to keep resident;
        ``memory_size`` is the whole unified RAM, shared with the OS). CUDA:
        85% of ``total_memory``. CPU: half of ``ram`` / ``local_ranks``.
    """
    if kind == "metal" and info.get("max_recommended_working_set_size"):
        return float(max(0, int(info["max_recommended_working_set_size"]) // local_ranks - in_use))
    if kind == "cuda" and info.get("total_memory"):
        return CUDA_SHARE * float(info["total_memory"])
    return CPU_SHARE * float(ram) / local_ranks


def default_budget_bytes(counted: int = 0) -> float:
    """``engine.memory_budget_gb: 0`` on this device (:func:`budget_bytes`).

    Args:
        counted: bytes of arrays the caller's estimate already includes
            (weights, LoRA); the rest of MLX's active memory is in use.
    """
    in_use = max(0, mx.get_active_memory() - counted)
    return budget_bytes(backend(), mx.device_info(), in_use, physical_memory(), local_ranks_from_env(os.environ))


def run_budget_bytes(memory_budget_gb: float) -> float:
    """What a run may hold in all (weights, arrays and MLX's buffer cache), in bytes:
    ``engine.memory_budget_gb`` when set, else :func:`budget_bytes` of this device with nothing in use."""
    if memory_budget_gb:
        return memory_budget_gb * GIB
    return budget_bytes(backend(), mx.device_info(), 0, physical_memory(), local_ranks_from_env(os.environ))


def trim_cache(budget: float) -> bool:
    """Empty MLX's buffer cache when the run's peak of arrays plus the cache exceed ``budget`` bytes.

    MLX keeps freed buffers for reuse (``mx.get_cache_memory``), which ``mx.get_peak_memory``
    does not count; when the lengths change from step to step they pile up beside the arrays
    (ml-explore/mlx#3993; mlx-lm's trainer empties the cache between steps,
    ``clear_cache_threshold``). Emptying it only when the next step could exceed the budget keeps
    the reuse where there is room. Returns whether it emptied the cache.
    """
    if mx.get_peak_memory() + mx.get_cache_memory() <= budget:
        return False
    mx.clear_cache()
    return True


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is MLX's report of a failed device allocation (any backend, :data:`OUT_OF_MEMORY`), or of
    Metal's limit on live buffers (:func:`is_buffer_limit`)."""
    return isinstance(err, (RuntimeError, MemoryError)) and (
        any(t in str(err).lower() for t in OUT_OF_MEMORY) or is_buffer_limit(err))


def is_buffer_limit(err: BaseException) -> bool:
    """MLX's Metal allocator refusing a buffer because the process holds as many as macOS allows
    (``iogpu.rsrc_limit``; "[metal::malloc] Resource limit (N) exceeded.", mlx PR 1718): a count, not bytes."""
    return "resource limit" in str(err).lower() and "exceeded" in str(err).lower()


def out_of_memory_text(where: str, budget_gb: float, err: BaseException) -> str:
    """One message for a run that ran out of device memory (or Metal's buffers) ``where``; the default budget is the
    one :func:`trim_cache` keeps to (:func:`run_budget_bytes`), not what is left after the arrays in use.

    Args:
        where: when, e.g. ``"after step 1 of 100"``.
        budget_gb: ``engine.memory_budget_gb`` as configured (0 = this device's default).
        err: MLX's error, quoted on its first line.
    """
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    kept = "checkpoints already written are intact and --train.resume auto continues from the latest"
    if is_buffer_limit(err):
        return (f"Metal's limit on live buffers reached {where} ({first}): MLX held more arrays at once than macOS "
                f"allows a process (iogpu.rsrc_limit), a count, not the memory budget; {kept}")
    budget = (f"engine.memory_budget_gb {budget_gb:g}" if budget_gb else
              f"the default memory budget ({run_budget_bytes(0) / GIB:.1f} GiB on this {backend()} device)")
    return (f"out of memory {where} ({first}; peak {mx.get_peak_memory() / GIB:.1f} GiB held by MLX): "
            f"{budget} is more than this device gives the run. Lower engine.memory_budget_gb (engine.kind auto then "
            f"recomputes layer ranges), train.micro_batch_pairs or data.max_length; {kept}")


def weight_bytes(model) -> int:
    """Bytes of every parameter of ``model`` (frozen and trainable)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@contextlib.contextmanager
def wired_limit(model, report: Optional[Callable[[str], None]] = None) -> Iterator[Optional[int]]:
    """On Metal, wire up to ``max_recommended_working_set_size`` (this rank's share of it: several
    ranks on one Mac) while the block runs; restore it after.

    Keeps the weights resident instead of paged out between steps
    (``mx.set_wired_limit``, as mlx-lm's trainer and ``generate.wired_limit``).
    When the weights alone exceed the working set, ``report`` gets one line.
    Elsewhere (CPU, CUDA) it changes nothing.

    Yields:
        The wired limit set (bytes), or None where nothing was set.
    """
    limit = mx.device_info().get("max_recommended_working_set_size") if backend() == "metal" else None
    if not limit:
        yield None
        return
    ranks = local_ranks_from_env(os.environ)
    limit = int(limit) // ranks
    weights = weight_bytes(model)
    if weights > limit and report is not None:
        share = "" if ranks == 1 else f"this rank's share (1 of {ranks} ranks on this Mac) of "
        report(f"the weights alone ({weights / GIB:.1f} GiB) exceed {share}Metal's recommended working set "
               f"({limit / GIB:.1f} GiB): expect paging and slow steps; a smaller or quantized model fits")
    previous = mx.set_wired_limit(limit)
    try:
        yield limit
    finally:
        mx.synchronize()  # no kernel may still run when the limit changes (mlx-lm does the same)
        mx.set_wired_limit(previous)
