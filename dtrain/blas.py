"""The fastest correct CPU BLAS for MLX, chosen where a process starts (Linux).

The ``mlx[cpu]`` wheel links a reference BLAS (``mlx_cpu.libs/libblas-*.so``,
netlib), far slower than an optimised one (docs/benchmarks.md). MLX calls ``cblas_sgemm`` through the dynamic linker, so a
library in the global symbol scope before ``libmlx.so`` loads serves those
calls instead: ``LD_PRELOAD`` for child processes, ``ctypes.CDLL(path,
RTLD_GLOBAL)`` in this one.

:func:`choose` probes each candidate in a short subprocess (a 512x512 float32
matmul timed, and results on a few shapes checked against numpy): Intel MKL
from pip (``libmkl_rt.so.*`` in this environment's ``lib``), the system's
OpenBLAS with its own core detection, and the same OpenBLAS with
``OPENBLAS_CORETYPE`` set from the CPU's flags when the library's choice ranks
lower (a library older than the CPU falls back to a generic, slower core,
e.g. Debian's 0.3.21 on an AVX-512 Xeon it did not recognise; issue 15). The fastest correct one wins;
with none, MLX's reference BLAS stays and the line gives the command that fixes it.

:func:`choose` keeps its result in ``cache_dir()/blas-<hash>.json`` and reuses it while
the candidate libraries (path, size, mtime), the CPU (model and flags), MLX's
version, the Python and the user's ``OPENBLAS_CORETYPE`` are the same: the
probes take seconds of both cores at every start otherwise.

:func:`setup` is the one entry used where a process starts (the ``dtrain``
command, the launcher through :func:`blas_env`, tests' conftest, bench
scripts); ``import dtrain`` loads nothing. :func:`warn_if_slow` tells a
program that imported MLX first what that costs.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from .blas_probe import PROBE_N, identify

OPENBLAS_PATHS = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
# OpenBLAS core types, best first, with the /proc/cpuinfo flags their kernels need
# (OpenBLAS builds them for -march=sapphirerapids, cooperlake, skylake-avx512; AVX2+FMA; AVX; SSSE3/SSE4.2; SSE3).
CORE_TYPES = (
    ("SapphireRapids", _AVX512 | {"avx512_bf16", "avx512_fp16", "amx_bf16"}),
    ("Cooperlake", _AVX512 | {"avx512_bf16"}),
    ("SkylakeX", _AVX512),
    ("Haswell", frozenset({"avx2", "fma"})),
    ("Sandybridge", frozenset({"avx"})),
    ("Nehalem", frozenset({"ssse3", "sse4_2"})),
    ("Core2", frozenset({"ssse3"})),
    ("Prescott", frozenset({"pni"})),  # the kernel's name for SSE3
)
ENV_KEY = "DTRAIN_BLAS"  # set by the launcher for its ranks: "kind,version,core,gflops"
CHILD_VARS = ("LD_PRELOAD", "OPENBLAS_CORETYPE", ENV_KEY)  # what a child process needs to use the choice


class BlasWarning(UserWarning):
    """MLX runs its CPU matmuls on a much slower BLAS than the one installed."""


@dataclass(frozen=True)
class Blas:
    """A BLAS for MLX's CPU matmuls and what its probe measured.

    ``kind``: ``openblas``, ``mkl``, ``reference`` (MLX's own) or ``accelerate``
    (macOS). ``path``: the library to load (None: MLX's own). ``core``: the
    OpenBLAS core type in use. ``gflops``: 512x512 float32 matmul rate, GFLOP/s.
    ``env``: variables that give a child process the same choice. ``notes``:
    what else the probes found (e.g. the library's own core and its rate).
    """

    kind: str
    path: Optional[str] = None
    version: str = ""
    core: Optional[str] = None
    gflops: Optional[float] = None
    env: dict = field(default_factory=dict)
    notes: tuple = ()
    inherited: bool = False

    def label(self) -> str:
        """``OpenBLAS 0.3.21 core SkylakeX``, ``Intel MKL 2026.2``, ..."""
        names = {"openblas": "OpenBLAS", "mkl": "Intel MKL", "reference": "MLX's bundled reference BLAS",
                 "accelerate": "MLX's own (Accelerate/Metal on macOS)"}
        name = " ".join(x for x in (names.get(self.kind, self.kind), self.version) if x)
        return name + (f" core {self.core}" if self.core else "")

    def line(self) -> str:
        """The one log line: which BLAS, its measured rate, and a fix when it is slow."""
        rate = f": {self.gflops:.1f} GFLOP/s on a {PROBE_N}x{PROBE_N} float32 matmul" if self.gflops else ""
        extra = "".join(f"; {n}" for n in self.notes)
        if self.kind == "reference":
            extra += f"; slow: no working OpenBLAS or MKL found, fix with: {install_hint()}"
        return f"BLAS: {self.label()}{rate}{extra}"


def install_hint() -> str:
    """The one command that installs a fast BLAS on this system."""
    os_release = Path("/etc/os-release").read_text() if Path("/etc/os-release").is_file() else ""
    if any(d in os_release for d in ("debian", "ubuntu")):
        return "sudo apt-get install libopenblas0-pthread"
    if platform.machine() in ("x86_64", "AMD64"):
        return f"{sys.executable} -m pip install mkl"
    return "install your distribution's OpenBLAS (pthread) package"


def cpu_flags(cpuinfo: str) -> frozenset:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` text (x86; empty elsewhere)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def core_types_for(flags) -> list[str]:
    """OpenBLAS core types whose kernels ``flags`` can run, best first (see CORE_TYPES)."""
    return [name for name, needs in CORE_TYPES if needs <= set(flags)]


def _rank(core: Optional[str]) -> int:
    """Position of ``core`` in CORE_TYPES (0 = best); len(CORE_TYPES) for a core not in the table."""
    names = [n.lower() for n, _ in CORE_TYPES]
    return names.index(core.lower()) if core and core.lower() in names else len(CORE_TYPES)


def find_openblas() -> Optional[str]:
    """Path of an installed OpenBLAS shared library (Linux), or None."""
    arch = platform.machine()
    for pattern in OPENBLAS_PATHS:
        for path in glob.glob(pattern.format(arch=arch)):
            if os.path.isfile(path):
                return path
    return None


def find_mkl() -> Optional[str]:
    """``libmkl_rt.so.*`` of the pip ``mkl`` package in this environment, or None."""
    found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so.*")))
    return found[-1] if found else None


def find_reference() -> Optional[str]:
    """The reference BLAS bundled with the ``mlx[cpu]`` wheel, found without importing MLX."""
    import importlib.util

    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "..", "mlx_cpu.libs", "libblas-*.so*"))
    return os.path.realpath(found[0]) if found else None


def probe(path: str, core: Optional[str] = None, env: Optional[dict] = None, timeout: float = 60.0) -> dict:
    """Load ``path`` in a fresh process (with ``OPENBLAS_CORETYPE=core``), check and time it.

    Returns the child's report: ``core`` (OpenBLAS's choice), ``version``,
    ``gflops``, ``max_error`` (relative to the error bound, <= 1 is correct),
    ``ok``; or ``ok: False`` with ``error`` (crash, timeout, core refused).
    """
    child = {k: v for k, v in (os.environ if env is None else env).items() if k not in CHILD_VARS}
    if core:
        child["OPENBLAS_CORETYPE"] = core
    cmd = [sys.executable, "-I", os.path.join(os.path.dirname(os.path.abspath(__file__)), "blas_probe.py"), path,
           core or ""]
    try:
        out = subprocess.run(cmd, env=child, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the probe did not finish in {timeout:.0f} s"}
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return {"ok": False, "error": f"the probe failed: {last}"}
    return json.loads(lines[-1])


def cache_file(key: dict) -> Path:
    """``cache_dir()/blas-<hash of key>.json``: one file per environment, so several checkouts coexist."""
    import hashlib

    from .files import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"blas-{digest}.json"


def probe_key(env: dict) -> dict:
    """What a probe's result depends on: candidate libraries (path, size, mtime), CPU model and
    flags, MLX's version, this Python (its environment and interpreter file: ``.venv/bin/python``
    and ``python3`` are one), the user's ``OPENBLAS_CORETYPE``, the probe's size."""
    from importlib import metadata

    libraries = {}
    for path in (find_mkl(), find_openblas(), find_reference()):
        if path:
            st = os.stat(path)
            libraries[path] = [st.st_size, st.st_mtime_ns]
    cpuinfo = _read("/proc/cpuinfo")
    model = next((x.split(":", 1)[1].strip() for x in cpuinfo.splitlines() if x.startswith("model name")), "")
    try:
        mlx_version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        mlx_version = ""
    return {"libraries": libraries, "cpu": [model, sorted(cpu_flags(cpuinfo))], "mlx": mlx_version,
            "python": [sys.prefix, os.path.realpath(sys.executable)], "user_core": env.get("OPENBLAS_CORETYPE") or "",
            "probe_n": PROBE_N}


def _cached(key: dict, path: Path) -> Optional[Blas]:
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") != key:
            return None
        b = saved["blas"]
        return Blas(b["kind"], b["path"], b["version"], b["core"], b["gflops"], dict(b["env"]),
                    (*b["notes"], f"probe result reused from {path} (delete it to probe again)"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save(key: dict, choice: Blas, path: Path) -> None:
    fields = {k: getattr(choice, k) for k in ("kind", "path", "version", "core", "gflops", "env")}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "blas": {**fields, "notes": list(choice.notes)}}, indent=1))
        os.replace(tmp, path)  # whole or not at all: launchers started together may write it at once
    except OSError:  # a read-only cache only costs the next start a probe
        try:
            tmp.unlink(missing_ok=True)  # cut short by a full disk: else one more at every start
        except OSError:
            pass


def choose(env: Optional[dict] = None, cache: bool = True) -> Blas:
    """The fastest correct BLAS on this machine, by probing each candidate (Linux; see module doc).

    ``cache``: reuse (and keep) the result in :func:`cache_file` while :func:`probe_key` is unchanged.
    """
    env = dict(os.environ if env is None else env)
    if platform.system() != "Linux":
        return Blas("accelerate" if platform.system() == "Darwin" else "mlx")
    if not cache:
        return _probe_all(env)
    key = probe_key(env)
    path = cache_file(key)
    choice = _cached(key, path)
    if choice is None:
        choice = _probe_all(env)
        if not any("did not finish" in n for n in choice.notes):  # a probe timed out: maybe only the load
            _save(key, choice, path)
    return choice


def _probe_all(env: dict) -> Blas:
    found, notes = [], []
    mkl = find_mkl()
    if mkl:
        report = probe(mkl, env=env)
        if report["ok"]:
            found.append(Blas("mkl", mkl, report["version"], None, report["gflops"], {"LD_PRELOAD": mkl}))
        else:
            notes.append(f"MKL at {mkl} not used: {report.get('error') or 'wrong results'}")
    openblas = find_openblas()
    if openblas:
        found += _openblas_candidates(openblas, env, notes)
    if not found:
        ref = find_reference()
        rate = probe(ref, env=env).get("gflops") if ref else None
        return Blas("reference", None, "", None, rate, {}, tuple(notes))
    best = max(found, key=lambda b: b.gflops or 0.0)
    return Blas(best.kind, best.path, best.version, best.core, best.gflops, best.env, best.notes + tuple(notes))


def _openblas_candidates(path: str, env: dict, notes: list) -> list[Blas]:
    """OpenBLAS with its own core choice (or the user's OPENBLAS_CORETYPE), and with the best
    core type for this CPU's flags that ranks above the library's choice and that it accepts."""
    user_core = env.get("OPENBLAS_CORETYPE") or None
    own = probe(path, user_core, env=env)
    out = []
    if own["ok"]:
        out.append(_openblas(path, own, user_core))
    elif own.get("error"):
        notes.append(f"OpenBLAS at {path} not used: {own['error']}")
    if user_core or not own.get("core"):
        return out
    for core in core_types_for(cpu_flags(_read("/proc/cpuinfo"))):
        if _rank(core) >= _rank(own["core"]) and _rank(own["core"]) < len(CORE_TYPES):
            break  # the library's own choice is at least as good as any core left to try
        forced = probe(path, core, env=env)
        if (forced.get("core") or "").lower() != core.lower():
            continue  # this OpenBLAS does not accept that core type here (0.3.21 without AVX512-BF16: Cooperlake): the next one
        if forced["ok"]:
            why = f"set by dtrain; the library's own choice, core {own['core']}, gave {own.get('gflops') or 0:.1f} GFLOP/s"
            out.append(_openblas(path, forced, core, (why,)))
        break
    return out


def _openblas(path: str, report: dict, forced: Optional[str], notes: tuple = ()) -> Blas:
    env = {"LD_PRELOAD": path, **({"OPENBLAS_CORETYPE": forced} if forced else {})}
    return Blas("openblas", path, report.get("version", ""), report.get("core"), report.get("gflops"), env, notes)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def blas_env(env: Optional[dict] = None, choice: Optional[Blas] = None) -> tuple[dict, Optional[str]]:
    """A copy of ``env`` (default os.environ) with which a child process uses the chosen BLAS.

    Sets ``LD_PRELOAD`` (prepended) and ``OPENBLAS_CORETYPE`` when dtrain chose
    them, and ``DTRAIN_BLAS`` (so the child's :func:`setup` does not probe
    again or print, MLX's reference BLAS too). Returns ``(env, line)``: the line to print once, or None
    when not on Linux. ``choice``: the BLAS to pass; default: the one this
    process has loaded (after :func:`setup`), else a fresh :func:`choose`.
    """
    env = dict(os.environ if env is None else env)
    if platform.system() != "Linux":
        return env, None
    loaded = global_cblas()
    choice = choice or (describe(loaded) if loaded else choose(env))
    if choice.path:
        preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != choice.path]
        env["LD_PRELOAD"] = ":".join([choice.path, *preload])
        env.update({k: v for k, v in choice.env.items() if k != "LD_PRELOAD"})
    env[ENV_KEY] = ",".join([choice.kind, choice.version, choice.core or "", f"{choice.gflops or 0:.1f}"])
    return env, choice.line()


def _from_env(env) -> Optional[Blas]:
    """The choice a launcher passed in ``DTRAIN_BLAS`` (with LD_PRELOAD; none for the reference BLAS), or None."""
    parts = env.get(ENV_KEY, "").split(",")
    preload = env.get("LD_PRELOAD", "").split(":")
    if len(parts) != 4 or not (preload[0] or parts[0] == "reference"):
        return None
    kind, version, core, gflops = parts
    path = None if kind == "reference" else preload[0]
    return Blas(kind, path, version, core or None, float(gflops or 0) or None,
                {k: env[k] for k in CHILD_VARS if k in env}, (), inherited=True)


def global_cblas() -> Optional[str]:
    """Path of the library that serves ``cblas_sgemm`` from the global symbol scope, or None.

    None means a later-loaded MLX binds its own bundled BLAS (``dlsym(RTLD_DEFAULT)``).
    """
    try:
        addr = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    info = DlInfo()
    for lib in (None, "libdl.so.2"):  # dladdr moved from libdl into libc in glibc 2.34
        try:
            if ctypes.CDLL(lib).dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) and info.fname:
                return os.path.realpath(info.fname.decode())
        except (AttributeError, OSError):
            continue
    return "(unnamed library)"


def describe(path: str) -> Blas:
    """The BLAS at ``path`` as loaded in this process (no rate): kind, version, OpenBLAS core."""
    kind, version, core = identify(ctypes.CDLL(path))  # already loaded: the same handle, no second init
    env = {"LD_PRELOAD": path, **({"OPENBLAS_CORETYPE": core} if core else {})}
    return Blas(kind, path, version, core, None, env)


def setup() -> Blas:
    """Choose the BLAS for this process and load it before MLX; returns the choice.

    Call once where a process starts, before the first ``import mlx``: it sets
    ``OPENBLAS_CORETYPE`` in ``os.environ`` (OpenBLAS reads it when it loads)
    and loads the library with ``RTLD_GLOBAL``. A choice passed by the launcher
    (``DTRAIN_BLAS`` and ``LD_PRELOAD``) is used as is (``inherited``). When
    MLX is already imported it only warns (:func:`warn_if_slow`).
    """
    if platform.system() != "Linux":
        return choose()
    if "mlx.core" in sys.modules:
        warn_if_slow(stacklevel=3)
        return Blas("unknown", global_cblas(), notes=("MLX was imported before dtrain.blas.setup()",))
    inherited, loaded = _from_env(os.environ), global_cblas()
    if inherited and loaded == (inherited.path and os.path.realpath(inherited.path)):  # reference: None, None
        return inherited
    if loaded:  # the user's LD_PRELOAD: too late to choose, say what it gives
        rate = probe(loaded).get("gflops")
        return replace(describe(loaded), gflops=rate, notes=("loaded by LD_PRELOAD before dtrain could choose",))
    choice = choose()
    if choice.path:
        os.environ.update({k: v for k, v in choice.env.items() if k != "LD_PRELOAD"})
        ctypes.CDLL(choice.path, mode=os.RTLD_GLOBAL)
    return choice


def mlx_gflops(n: int = PROBE_N, repeats: int = 3) -> float:
    """MLX's own float32 matmul rate on the CPU in this process, GFLOP/s (best of ``repeats``)."""
    import mlx.core as mx

    a = mx.random.normal((n, n), stream=mx.cpu)
    b = mx.random.normal((n, n), stream=mx.cpu)
    mx.eval(mx.matmul(a, b, stream=mx.cpu))  # warm-up: thread pools, first-call dispatch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def warn_if_slow(stacklevel: int = 2) -> Optional[str]:
    """Warn (:class:`BlasWarning`) when the already imported MLX runs CPU matmuls on its
    reference BLAS while a correct library at least 2x faster is installed.

    Returns the message, or None. Cheap when a BLAS is in the global symbol
    scope (setup() ran first or LD_PRELOAD); otherwise measures MLX's rate and
    probes the candidates (a fraction of a second).
    """
    if platform.system() != "Linux" or "mlx.core" not in sys.modules or global_cblas():
        return None
    if not (find_openblas() or find_mkl()):
        return None  # nothing faster installed; the reference BLAS line already gave the fix
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return None
    have = mlx_gflops()
    best = choose()
    if not best.path or (best.gflops or 0) < 2 * have:
        return None
    msg = (f"MLX was imported before dtrain.blas.setup(), so its CPU matmuls use the reference BLAS: "
           f"{have:.1f} GFLOP/s measured against {best.gflops:.1f} with {best.label()}, "
           f"so matmuls run about {best.gflops / have:.0f}x slower. Call dtrain.blas.setup() before the first "
           f"`import mlx` (the dtrain command and ./launch do this).")
    warnings.warn(msg, BlasWarning, stacklevel=stacklevel)
    return msg
