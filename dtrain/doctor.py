"""``dtrain doctor``: what a bug report needs, in lines to paste.

MLX and its backend, the device and its memory figures (Metal's recommended
working set and wired limit, the budget ``engine.kind: auto`` plans within),
the BLAS (Linux), the distributed backends MLX was built with, Python and the
OS, and a short demo run timed step by step with its peak memory.
Import it after :func:`dtrain.blas.setup` (the ``dtrain`` command does).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Optional

import mlx.core as mx

from . import memory
from .contract import local_ranks_from_env
from .launch.hosts import LaunchError
from .launch.plan import mlx_launch_path, mpi_library_env

GIB = memory.GIB
DISTRIBUTED = ("ring", "mpi", "jaccl", "nccl")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gib(n) -> str:
    return f"{n / GIB:.2f} GiB ({int(n):,} bytes)"


def _os_line() -> str:
    if platform.system() == "Darwin":
        return f"macOS {platform.mac_ver()[0]} ({platform.machine()})"
    return f"{platform.platform()} ({platform.machine()})"


def current_wired_limit() -> Optional[int]:
    """Metal's wired limit now (bytes), read by setting it and putting it back; None elsewhere."""
    if not mx.metal.is_available():
        return None
    try:
        previous = mx.set_wired_limit(0)
    except (RuntimeError, ValueError):  # an MLX or macOS without wired limits
        return None
    mx.set_wired_limit(previous)
    return previous


def _wired_plan() -> str:
    """What a run does with the wired limit here: MLX keeps buffers resident through Metal residency sets,
    which macOS 15 brought (``mlx/backend/metal/resident.cpp``); before it the limit keeps nothing resident."""
    release = platform.mac_ver()[0]
    if release and int(release.split(".")[0]) < 15:
        return f"it has no effect on macOS {release} (MLX wires memory on macOS 15 or later)"
    ranks = local_ranks_from_env(os.environ)
    share = "" if ranks == 1 else f" divided by the {ranks} ranks on this Mac"
    return f"a training run sets it to the recommended working set{share}"


def device_error() -> Optional[str]:
    """MLX's error (its first line) when it cannot use its default device, else None.

    A Metal build reports ``mx.metal.is_available()`` True and defaults to the GPU even where
    macOS gives the process no Metal device (a virtual machine, a headless or sandboxed
    session); its first device call then raises ``[metal::load_device] No Metal device
    available...`` (``mlx/backend/metal/device.cpp``).
    """
    try:
        mx.device_info()
        mx.get_active_memory()
    except RuntimeError as err:
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return None


def system_lines(blas_line: Optional[str]) -> list[str]:
    """Versions, device, memory figures, BLAS and distributed backends, one ``name: value`` per line."""
    kind = memory.backend()
    lines = [
        f"dtrain: {_version('dtrain')}; mlx: {mx.__version__}; mlx-lm: {_version('mlx-lm')}",
        f"python: {platform.python_version()} ({sys.executable})",
        f"os: {_os_line()}; {os.cpu_count()} CPU threads; RAM {_gib(memory.physical_memory())}",
        f"backend: {kind} (default device {mx.default_device()}; metal available: {mx.metal.is_available()}, "
        f"cuda available: {mx.cuda.is_available()})",
    ]
    problem = device_error()
    if problem is not None:
        lines.append(f"device: MLX cannot use it: {problem}")
        return lines + _distributed_lines(blas_line)
    info = dict(mx.device_info(mx.gpu) if mx.metal.is_available() else mx.device_info())  # Metal's even if CPU is default
    lines += [
        f"device: {info.get('device_name', '?')} ({info.get('architecture', '?')})",
        "device_info: " + ", ".join(f"{k}={v}" for k, v in sorted(info.items())),
    ]
    if "max_recommended_working_set_size" in info:
        lines.append(f"recommended working set: {_gib(info['max_recommended_working_set_size'])}; "
                     f"unified memory: {_gib(info.get('memory_size', 0))}")
        wired = current_wired_limit()
        lines.append(f"wired limit: {'not readable' if wired is None else _gib(wired)} now; {_wired_plan()}")
    elif "total_memory" in info:
        lines.append(f"GPU memory: total {_gib(info['total_memory'])}, free {_gib(info.get('free_memory', 0))}")
    lines.append(f"MLX memory limit: {_gib(mx.get_memory_limit())}")
    lines.append(f"auto engine budget (engine.memory_budget_gb: 0): {_gib(memory.default_budget_bytes())}")
    return lines + _distributed_lines(blas_line)


def _distributed_lines(blas_line: Optional[str]) -> list[str]:
    """The BLAS line (Linux) and the distributed backends this MLX has, with mlx.launch and mpirun."""
    lines = []
    if blas_line:
        lines.append(blas_line)
    mpirun = shutil.which("mpirun")
    if mpirun and not os.environ.get("MLX_MPI_LIBNAME"):  # the libmpi ./launch gives MPI ranks, before MLX loads one
        os.environ.update({k: v for k, v in mpi_library_env(mpirun).items() if k == "MLX_MPI_LIBNAME"})
    built = [b for b in DISTRIBUTED if mx.distributed.is_available(b)]
    try:
        launch = mlx_launch_path()
    except LaunchError:
        launch = "not found"
    libmpi = f" (libmpi: {os.environ['MLX_MPI_LIBNAME']})" if mpirun and os.environ.get("MLX_MPI_LIBNAME") else ""
    lines.append(f"distributed backends in this MLX: {', '.join(built) or 'none'}; mlx.launch: {launch}; "
                 f"mpirun: {mpirun or 'not found'}{libmpi}")
    return lines


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if platform.system() == "Darwin" else peak * 1024


def demo_lines(steps: int = 2, max_length: int = 128, pairs: int = 4, model: str = "demo") -> list[str]:
    """Train ``steps`` steps of ``pairs`` generated pairs (``max_length`` tokens per side) on
    ``model``; one line per step with its seconds, and the peaks of MLX memory and RSS."""
    from .config import load_config
    from .run.trainer import Hooks, train

    times, peaks, engine, got = [], [], [], []

    def stop(signum, frame):  # the command's own handler (KeyboardInterrupt, cli.Interrupted), the signal noted
        got.append(signum)
        previous[signum](signum, frame)

    def stopped():
        # the exception a stop raised can be swallowed on its way (seen: in an importlib callback), and the run
        # trained on deaf to it: raised again at the next step's edge
        if got:
            previous[got[0]](got[0], None)

    def before(_step, run):
        stopped()
        engine[:] = [run.engine.name]
        mx.reset_peak_memory()
        times.append(time.perf_counter())

    def after(_step, _run):
        stopped()
        times[-1] = time.perf_counter() - times[-1]
        peaks.append(mx.get_peak_memory())

    with tempfile.TemporaryDirectory(prefix="dtrain-doctor-") as out:
        cfg = load_config(overrides=[
            f"model.path={model}", f"data.demo_pairs={pairs * 2}", f"data.max_length={max_length}",
            f"data.max_prompt_length={max_length * 3 // 4}", "data.valid_fraction=0.25", f"train.steps={steps}",
            f"train.global_batch_pairs={pairs}", f"train.micro_batch_pairs={pairs}", "train.warmup_steps=0",
            "train.eval_pairs=1", "train.progress=false", f"train.output_dir={out}"])
        start = time.perf_counter()
        # a stop ends doctor as any command (dtrain: interrupted, this folder removed): not a run's stop,
        # whose save and 'continue with --train.resume auto' would be of a folder about to go
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        previous = {sig: h for sig, h in previous.items()  # an ignored signal stays ignored; handlers: main thread
                    if callable(h) and threading.current_thread() is threading.main_thread()}
        try:
            for sig in previous:
                signal.signal(sig, stop)
            train(cfg, hooks=Hooks(before_step=before, after_step=after, stop_signals=False))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        total = time.perf_counter() - start
    lines = [f"demo run: model {model}, {steps} step{'s' * (steps > 1)} of {pairs} pair{'s' * (pairs > 1)} "
             f"(<= {max_length} tokens per side), "
             f"engine {cfg.engine.kind} ({''.join(engine)}); {total:.1f} s in all (loading, data, evaluation, saving included)"]
    for i, (s, p) in enumerate(zip(times, peaks), 1):
        lines.append(f"  step {i}: {s:.2f} s, peak MLX memory {_gib(p)}" + (" (includes warm-up)" if i == 1 else ""))
    lines.append(f"  peak RSS of this process: {_gib(_peak_rss())}")
    return lines
