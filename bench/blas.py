"""Float32 matmul rate of each CPU BLAS MLX can use on this machine.

    python bench/blas.py --repeats 5 [--mkl /path/to/libmkl_rt.so.3]

Rows: MLX's bundled reference BLAS; the installed OpenBLAS with its own core
choice; the same OpenBLAS with each ``OPENBLAS_CORETYPE`` this CPU can run and
the library accepts; MKL (``--mkl``, or the pip ``mkl`` package in this
environment). Each is measured in fresh processes two ways: ``cblas_sgemm``
called directly at 512x512 (dtrain.blas.probe, which also checks results
against numpy) and ``mx.matmul`` at 512 and 1024 with the library preloaded
(``LD_PRELOAD``), as MLX uses it in training. Rows are measured round-robin,
``--repeats`` times, so load from other processes spreads over all of them;
the table gives median and range, and the load average before and after.

Prints a markdown table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from prelude import RESULTS, add_flags, machine, write_results

from dtrain import blas  # noqa: E402  (dtrain.blas loads nothing on import)

MLX_RATE = """
import time, mlx.core as mx
for n in (512, 1024):
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a @ b)  # warm-up
    times = []
    for _ in range(5):
        start = time.perf_counter(); mx.eval(a @ b); times.append(time.perf_counter() - start)
    print(n, 2 * n**3 / min(times) / 1e9)
"""


def mlx_rates(path: str | None, core: str | None) -> dict:
    """``{512: GFLOP/s, 1024: GFLOP/s}`` of ``mx.matmul`` in a fresh process with ``path`` preloaded."""
    env = {k: v for k, v in os.environ.items() if k not in blas.CHILD_VARS}
    if path:
        env["LD_PRELOAD"] = path
    if core:
        env["OPENBLAS_CORETYPE"] = core
    out = subprocess.run([sys.executable, "-c", MLX_RATE], env=env, capture_output=True, text=True, check=True)
    return {int(n): float(r) for n, r in (line.split() for line in out.stdout.splitlines())}


def rows(mkl: str | None) -> list[tuple[str, str | None, str | None]]:
    """``(label, library, core type)`` for every BLAS to measure here."""
    out = [("reference BLAS (bundled with mlx[cpu])", blas.find_reference(), None)]
    openblas = blas.find_openblas()
    if openblas:
        own = blas.probe(openblas)
        out.append((f"OpenBLAS {own['version']}, its own choice ({own['core']})", openblas, None))
        flags = blas.cpu_flags(Path("/proc/cpuinfo").read_text())
        for core in blas.core_types_for(flags):
            got = blas.probe(openblas, core)
            if (got.get("core") or "").lower() == core.lower():
                out.append((f"OpenBLAS {own['version']}, OPENBLAS_CORETYPE={core}", openblas, core))
            else:
                print(f"OpenBLAS {own['version']} does not accept OPENBLAS_CORETYPE={core}", file=sys.stderr)
    mkl = mkl or blas.find_mkl()
    if mkl:
        out.append((f"Intel MKL {blas.probe(mkl)['version']} (pip mkl)", mkl, None))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mkl", help="libmkl_rt.so.* to measure (default: the pip mkl package in this environment)")
    add_flags(p, out=str(RESULTS))
    a = p.parse_args()
    load_before = os.getloadavg()
    table = rows(a.mkl)
    runs = {label: {"cblas512": [], "mlx512": [], "mlx1024": [], "max_error": []} for label, _, _ in table}
    for _ in range(a.repeats):
        for label, path, core in table:
            report = blas.probe(path, core)
            mlx = mlx_rates(None if "reference" in label else path, core)
            runs[label]["cblas512"].append(report["gflops"])
            runs[label]["max_error"].append(report["max_error"])
            runs[label]["mlx512"].append(mlx[512])
            runs[label]["mlx1024"].append(mlx[1024])
    load_after = os.getloadavg()
    import mlx.core as mx

    print(f"CPU: {machine()['cpu']}, {os.cpu_count()} cores; MLX {mx.__version__}; load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after; GFLOP/s, median (min-max) of {a.repeats}\n")
    print("| BLAS | cblas_sgemm 512 | mx.matmul 512 | mx.matmul 1024 | max error / bound |")
    print("|---|---|---|---|---|")

    def cell(v):
        return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"

    for label, r in runs.items():
        print(f"| {label} | {cell(r['cblas512'])} | {cell(r['mlx512'])} | {cell(r['mlx1024'])} | {max(r['max_error']):.4f} |")
    path = write_results("blas", {"mlx": mx.__version__, "load_before": load_before, "load_after": load_after,
                                  "runs": runs}, a.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
