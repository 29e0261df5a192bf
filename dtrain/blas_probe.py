"""The BLAS probe: load one CBLAS library, check ``cblas_sgemm`` and time it.

Run by :func:`dtrain.blas.probe` as ``python -I dtrain/blas_probe.py PATH [CORE]``
in a fresh process (so a crash, a refused core type or a hang cannot take the
caller down), it prints one JSON report. Standard library and numpy only: under
``-I`` the package is not importable. :func:`identify` is also used in-process.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from typing import Optional

PROBE_N = 512  # the probe's matmul size: ~2 ms with OpenBLAS, ~80 ms with the reference BLAS


def identify(lib) -> tuple[str, str, Optional[str]]:
    """``(kind, version, core)`` of a loaded BLAS from its own query functions."""
    if hasattr(lib, "openblas_get_corename"):
        lib.openblas_get_corename.restype = ctypes.c_char_p
        lib.openblas_get_config.restype = ctypes.c_char_p
        return "openblas", lib.openblas_get_config().decode().split()[1], lib.openblas_get_corename().decode()
    if hasattr(lib, "MKL_Get_Version_String"):
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, 256)  # "Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build ..."
        return "mkl", buf.value.decode().split("Version ")[-1].split("-")[0].split()[0], None
    return "other", "", None


def probe_main(path: str, core: str) -> dict:
    """The report :func:`dtrain.blas.probe` reads: ``ok``, ``kind``, ``version``, ``core``, ``gflops``, ``max_error``."""
    lib = ctypes.CDLL(path)
    kind, version, got = identify(lib)
    report = {"ok": False, "kind": kind, "version": version, "core": got}
    if core and (got or "").lower() != core.lower():
        return {**report, "error": f"OPENBLAS_CORETYPE={core} not accepted"}  # before importing numpy: cheap
    import numpy as np

    sgemm = lib.cblas_sgemm
    sgemm.restype = None
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    a, b = (np.random.default_rng(i).standard_normal((PROBE_N, PROBE_N), dtype=np.float32) for i in (1, 2))
    times, c = [], None
    while len(times) < 5 and sum(times) < 0.3:  # best of 5, or of what fits in 0.3 s (reference BLAS)
        seconds, c = matmul_time(sgemm, a, b)
        times.append(seconds)
    report["max_error"] = max(verify(sgemm, np), _error(c, a.astype(np.float64) @ b.astype(np.float64), a, b, np))
    report.update(gflops=2 * PROBE_N**3 / min(times) / 1e9, ok=bool(report["max_error"] <= 1.0))
    return report


def matmul_time(sgemm, a, b):
    """``(seconds, c)`` for one row-major ``c = a @ b`` through ``cblas_sgemm`` (float32 numpy arrays)."""
    import numpy as np

    c = np.empty((a.shape[0], b.shape[1]), np.float32)
    start = time.perf_counter()
    sgemm(101, 111, 111, a.shape[0], b.shape[1], a.shape[1], 1.0, a.ctypes.data, a.shape[1],
          b.ctypes.data, b.shape[1], 0.0, c.ctypes.data, c.shape[1])
    return time.perf_counter() - start, c


def _error(c, want, a, b, np) -> float:
    """max |c - want| over the float32 bound 4 * eps * k * max_i |a_i| * max_j |b_j| (Cauchy-Schwarz
    on the rows of ``a`` and the columns of ``b``, as multiplied); NaN/inf count as wrong."""
    k = a.shape[1]
    scale = float(np.linalg.norm(a, axis=1).max() * np.linalg.norm(b, axis=0).max())
    err = float(np.abs(c - want).max()) / (4 * float(np.finfo(np.float32).eps) * k * max(scale, 1.0))
    return err if np.isfinite(err) else float("inf")


def verify(sgemm, np) -> float:
    """Largest :func:`_error` of ``cblas_sgemm`` against float64 numpy over small odd shapes,
    both transposes and nonzero beta (<= 1: correct)."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for m, n, k, ta, tb, beta in ((37, 19, 73, False, True, 0.0), (1, 300, 64, True, False, 0.5),
                                  (129, 65, 257, True, True, 1.0), (64, 1, 300, False, False, 0.0)):
        a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
        c = rng.standard_normal((m, n), dtype=np.float32)
        a_, b_ = (a.T if ta else a), (b.T if tb else b)
        want = a_.astype(np.float64) @ b_.astype(np.float64) + beta * c.astype(np.float64)
        sgemm(101, 112 if ta else 111, 112 if tb else 111, m, n, k, 1.0, a.ctypes.data, a.shape[1],
              b.ctypes.data, b.shape[1], beta, c.ctypes.data, n)
        worst = max(worst, _error(c, want, a_, b_, np))
    return worst


if __name__ == "__main__":
    print(json.dumps(probe_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")))
