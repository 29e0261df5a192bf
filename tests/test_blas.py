"""dtrain.blas: core type from CPU flags, the probe's correctness check, the
choice logic, the warning when MLX was imported first, and the ranks' environment."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtrain import blas, blas_probe
from waiting import needs_proc

ROOT = Path(__file__).resolve().parents[1]
FAST = blas.find_openblas() or blas.find_mkl()
needs_fast = pytest.mark.skipif(not FAST, reason="no OpenBLAS or MKL installed")
needs_openblas = pytest.mark.skipif(not blas.find_openblas(), reason="no OpenBLAS installed")
chooses_a_blas = pytest.mark.skipif(platform.system() != "Linux",  # blas.setup(): MLX's own elsewhere, no probe
                                    reason="dtrain chooses a BLAS on Linux only (macOS: MLX's own)")

BASE = "fpu sse sse2 pni ssse3 fma sse4_1 sse4_2 avx avx2 "
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl "
ICE_LAKE = BASE + AVX512 + "avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq"
COOPER_LAKE = BASE + AVX512 + "avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = COOPER_LAKE + " avx512_fp16 amx_bf16 amx_tile amx_int8"
KNIGHTS_LANDING = BASE + "avx512f avx512cd avx512er avx512pf"  # no BW/DQ/VL: SkylakeX kernels would fault
ZEN3 = BASE
CORE2 = "fpu sse sse2 pni ssse3"


@pytest.mark.parametrize("flags, first", [
    (ICE_LAKE, "SkylakeX"), (COOPER_LAKE, "Cooperlake"), (SAPPHIRE_RAPIDS, "SapphireRapids"),
    (KNIGHTS_LANDING, "Haswell"), (ZEN3, "Haswell"), (CORE2, "Core2"), ("fpu sse sse2", None),
])
def test_core_type_from_cpu_flags(flags, first):
    got = blas.core_types_for(flags.split())
    assert (got[0] if got else None) == first


def test_core_types_are_best_first_and_skip_what_the_cpu_lacks():
    assert blas.core_types_for(COOPER_LAKE.split()) == [
        "Cooperlake", "SkylakeX", "Haswell", "Sandybridge", "Nehalem", "Core2", "Prescott"]
    assert blas.core_types_for(KNIGHTS_LANDING.split()) == ["Haswell", "Sandybridge", "Nehalem", "Core2", "Prescott"]


def test_cpu_flags_reads_the_first_processor():
    text = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert blas.cpu_flags(text) == {"fpu", "avx2", "fma"}
    assert blas.cpu_flags("processor : 0\nFeatures : fp asimd\n") == frozenset()  # arm64: no x86 flags


def _numpy_sgemm(wrong_at=None):
    """A ``cblas_sgemm`` (row-major) in numpy; ``wrong_at=(i, j)`` adds 1 to that output element."""
    def view(ptr, rows, cols):
        return np.ctypeslib.as_array((ctypes.c_float * (rows * cols)).from_address(ptr)).reshape(rows, cols)

    def sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        assert order == 101
        A = view(a, k, lda).T if ta == 112 else view(a, m, lda)
        B = view(b, n, ldb).T if tb == 112 else view(b, k, ldb)
        C = view(c, m, ldc)
        C[:] = alpha * (A.astype(np.float64) @ B) + beta * C
        if wrong_at is not None and wrong_at[0] < m and wrong_at[1] < n:
            C[wrong_at] += 1.0
    return sgemm


def test_verify_accepts_a_correct_sgemm_and_rejects_one_wrong_element():
    assert blas_probe.verify(_numpy_sgemm(), np) < 1e-3
    # one element off by 1.0 in a 37x19 result (k=73): the bound 4 * eps * k * |row| * |column| is ~4e-3
    assert blas_probe.verify(_numpy_sgemm(wrong_at=(3, 5)), np) > 100


def _fake_probe(reports: dict, calls: list):
    def probe(path, core=None, env=None):
        calls.append(core)
        return reports[core]
    return probe


def test_openblas_falling_back_to_a_generic_core_gets_the_best_core_it_accepts(monkeypatch):
    """Issue 15's machine: OpenBLAS 0.3.21 picks Prescott on an AVX-512 + BF16 Xeon and refuses
    OPENBLAS_CORETYPE=Cooperlake (it falls back to its own choice); SkylakeX is accepted."""
    calls = []
    reports = {
        None: {"ok": True, "core": "Prescott", "version": "0.3.21", "gflops": 30.0},
        "Cooperlake": {"ok": False, "core": "Prescott", "version": "0.3.21", "error": "not accepted"},
        "SkylakeX": {"ok": True, "core": "SkylakeX", "version": "0.3.21", "gflops": 140.0},
    }
    monkeypatch.setattr(blas, "probe", _fake_probe(reports, calls))
    monkeypatch.setattr(blas, "_read", lambda path: f"flags\t: {COOPER_LAKE}\n")
    found = blas._openblas_candidates("/lib/libopenblas.so.0", {}, [])
    assert calls == [None, "Cooperlake", "SkylakeX"]
    best = max(found, key=lambda b: b.gflops)
    assert (best.core, best.env) == ("SkylakeX", {"LD_PRELOAD": "/lib/libopenblas.so.0", "OPENBLAS_CORETYPE": "SkylakeX"})
    assert best.line() == ("BLAS: OpenBLAS 0.3.21 core SkylakeX: 140.0 GFLOP/s on a 512x512 float32 matmul; "
                           "set by dtrain; the library's own choice, core Prescott, gave 30.0 GFLOP/s")


def test_openblas_that_knows_the_cpu_is_probed_once(monkeypatch):
    calls = []
    reports = {None: {"ok": True, "core": "SkylakeX", "version": "0.3.21", "gflops": 150.0}}
    monkeypatch.setattr(blas, "probe", _fake_probe(reports, calls))
    monkeypatch.setattr(blas, "_read", lambda path: f"flags\t: {ICE_LAKE}\n")
    (only,) = blas._openblas_candidates("/lib/libopenblas.so.0", {}, [])
    assert calls == [None] and only.env == {"LD_PRELOAD": "/lib/libopenblas.so.0"}


def test_a_user_core_type_is_kept(monkeypatch):
    calls = []
    reports = {"Haswell": {"ok": True, "core": "Haswell", "version": "0.3.21", "gflops": 100.0}}
    monkeypatch.setattr(blas, "probe", _fake_probe(reports, calls))
    monkeypatch.setattr(blas, "_read", lambda path: f"flags\t: {ICE_LAKE}\n")
    (only,) = blas._openblas_candidates("/x.so", {"OPENBLAS_CORETYPE": "Haswell"}, [])
    assert calls == ["Haswell"] and only.env["OPENBLAS_CORETYPE"] == "Haswell"


def _probed_machine(monkeypatch, tmp_path, cpuinfo: str):
    """A machine with one OpenBLAS file (tmp), ``cpuinfo``, and a counting fake probe; returns the calls list."""
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"v1")
    calls = []
    reports = {None: {"ok": True, "core": "SkylakeX", "version": "0.3.21", "gflops": 150.0},
               "Haswell": {"ok": True, "core": "Haswell", "version": "0.3.21", "gflops": 90.0}}
    monkeypatch.setenv("DTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(blas.platform, "system", lambda: "Linux")
    monkeypatch.setattr(blas, "find_mkl", lambda: None)
    monkeypatch.setattr(blas, "find_reference", lambda: None)
    monkeypatch.setattr(blas, "find_openblas", lambda: str(lib))
    monkeypatch.setattr(blas, "probe", _fake_probe(reports, calls))
    monkeypatch.setattr(blas, "_read", lambda path: cpuinfo)
    return calls


def test_the_probe_result_is_reused_while_library_and_cpu_are_the_same(monkeypatch, tmp_path):
    calls = _probed_machine(monkeypatch, tmp_path, f"model name\t: Xeon A\nflags\t: {ICE_LAKE}\n")
    first = blas.choose({})
    again = blas.choose({})
    assert calls == [None]  # probed once
    assert (again.kind, again.path, again.version, again.core, again.gflops, again.env) == (
        first.kind, first.path, first.version, first.core, first.gflops, first.env)
    (cache,) = (tmp_path / "cache").glob("blas-*.json")
    assert again.line() == (f"BLAS: OpenBLAS 0.3.21 core SkylakeX: 150.0 GFLOP/s on a 512x512 float32 matmul; "
                            f"probe result reused from {cache} (delete it to probe again)")
    assert blas.choose({}, cache=False).line() == first.line() and calls == [None, None]



def test_a_probe_result_a_full_disk_cannot_take_leaves_no_partial_file(monkeypatch, tmp_path):
    """A full disk as the probe's result was saved left ``.blas-<hash>.json.<pid>`` (cut short) in the cache
    folder, one more at every start while it stayed full; the start goes on, and the next one probes again."""
    calls = _probed_machine(monkeypatch, tmp_path, f"model name\t: Xeon A\nflags\t: {ICE_LAKE}\n")

    def full_disk(path, text, **_kw):
        with open(path, "w") as f:
            f.write(text[:10])
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert blas.choose({}).core == "SkylakeX" and calls == [None]
    assert os.listdir(tmp_path / "cache") == []

def test_the_same_environment_by_another_interpreter_name_reuses_the_probe(monkeypatch, tmp_path):
    """.venv/bin/python and .venv/bin/python3 (after activating the venv) probed twice, and kept two files."""
    calls = _probed_machine(monkeypatch, tmp_path, f"model name\t: Xeon A\nflags\t: {ICE_LAKE}\n")
    other = tmp_path / "bin" / "python3"
    other.parent.mkdir()
    other.symlink_to(sys.executable)
    blas.choose({})
    monkeypatch.setattr(blas.sys, "executable", str(other))
    assert "reused" in blas.choose({}).line() and calls == [None]
    assert len(list((tmp_path / "cache").glob("blas-*.json"))) == 1


@pytest.mark.parametrize("change", ["library rewritten", "cpu model", "cpu flags", "mlx version", "user core type"])
def test_a_changed_library_cpu_or_mlx_probes_again(monkeypatch, tmp_path, change):
    cpuinfo = f"model name\t: Xeon A\nflags\t: {ICE_LAKE}\n"
    calls = _probed_machine(monkeypatch, tmp_path, cpuinfo)
    env = {}
    blas.choose(env)
    assert calls == [None]
    if change == "library rewritten":  # same path, new content: size and mtime differ
        lib = tmp_path / "libopenblas.so.0"
        lib.write_bytes(b"version 2")
        os.utime(lib, ns=(1, 1))
    elif change == "cpu model":
        monkeypatch.setattr(blas, "_read", lambda path: cpuinfo.replace("Xeon A", "Xeon B"))
    elif change == "cpu flags":
        monkeypatch.setattr(blas, "_read", lambda path: cpuinfo.replace(" avx512vbmi", ""))
    elif change == "mlx version":
        from importlib import metadata

        real = metadata.version
        monkeypatch.setattr(metadata, "version", lambda name: "0.0.1" if name == "mlx" else real(name))
    else:
        env = {"OPENBLAS_CORETYPE": "Haswell"}
    again = blas.choose(env)
    assert len(calls) == 2 and "reused" not in again.line()
    assert "reused" in blas.choose(env).line() and len(calls) == 2  # the new result is kept


@needs_openblas
def test_probe_checks_and_times_the_installed_openblas():
    report = blas.probe(blas.find_openblas(), "Prescott")
    assert report["ok"] and report["core"] == "Prescott" and report["max_error"] < 1 and report["gflops"] > 0


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in blas.CHILD_VARS}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@needs_proc  # the libraries loaded, from /proc/self/maps
def test_import_dtrain_loads_no_blas():
    code = ("import os, dtrain, dtrain.cli, dtrain.config, dtrain.blas\n"
            "maps = open('/proc/self/maps').read()\n"
            "libs = [p for p in (dtrain.blas.find_openblas(), dtrain.blas.find_mkl()) if p]\n"
            "print(dtrain.blas.global_cblas(), any(os.path.realpath(p) in maps for p in libs), 'libmlx' in maps)")
    r = _python(code, _clean_env())
    assert r.stdout.split() == ["None", "False", "False"], r.stderr


@needs_fast
def test_mlx_imported_first_warns_with_the_measured_cost():
    r = _python("import mlx.core\nfrom dtrain.blas import setup\nsetup()", _clean_env())
    assert r.returncode == 0, r.stderr
    assert re.search(r"BlasWarning: MLX was imported before dtrain\.blas\.setup\(\), so its CPU matmuls use the "
                     r"reference BLAS: [\d.]+ GFLOP/s measured against [\d.]+ with (OpenBLAS|Intel MKL) [^,]+, "
                     r"so matmuls run about \d+x slower\. Call dtrain\.blas\.setup\(\) before the first `import mlx`",
                     r.stderr), r.stderr


@needs_fast
def test_setup_before_mlx_serves_mlx_matmuls_without_a_warning():
    code = ("import os, warnings\nfrom dtrain import blas\nchoice = blas.setup()\nimport mlx.core\n"
            "warnings.simplefilter('error')\nassert blas.warn_if_slow() is None\n"
            "print(blas.global_cblas() == os.path.realpath(choice.path), choice.inherited)")
    r = _python(code, _clean_env())
    assert r.stdout.split() == ["True", "False"], r.stderr


@needs_openblas
def test_ranks_get_the_launchers_choice_and_use_it_quietly():
    """The launcher's environment for ranks: LD_PRELOAD, the core type and DTRAIN_BLAS; a rank's
    setup() takes that choice without probing, and OpenBLAS runs with that core."""
    launcher_env = _clean_env(OPENBLAS_CORETYPE="Haswell")  # the user's core type, kept
    env, line = blas.blas_env(launcher_env, blas.choose(launcher_env))  # as the launcher, which loads no BLAS
    path = blas.find_openblas()
    assert env["LD_PRELOAD"] == path and env["OPENBLAS_CORETYPE"] == "Haswell"
    assert re.fullmatch(r"openblas,[\d.]+,Haswell,[\d.]+", env["DTRAIN_BLAS"]) and "core Haswell" in line
    code = ("from dtrain import blas\nb = blas.setup()\n"
            "print(b.inherited, b.core, blas.describe(blas.global_cblas()).core)")
    r = _python(code, env)
    assert r.stdout.split() == ["True", "Haswell", "Haswell"], r.stderr


@chooses_a_blas
def test_ranks_get_a_reference_blas_choice_too_and_use_it_quietly():
    """A launcher that found no working OpenBLAS or MKL passed nothing: each rank chose again and printed
    the BLAS line the launcher had printed (test_dtrain_train_prints_the_blas_line_unless_a_launcher_did
    failed on such a machine)."""
    env, _ = blas.blas_env(_clean_env(), blas.Blas("reference", gflops=5.9))
    assert env["DTRAIN_BLAS"] == "reference,,,5.9" and "LD_PRELOAD" not in env
    code = "from dtrain import blas\nb = blas.setup()\nprint(b.inherited, b.kind, blas.global_cblas())"
    r = _python(code, env)
    assert r.stdout.split() == ["True", "reference", "None"], r.stderr  # nothing loaded: MLX's own, as passed


@needs_openblas
def test_launch_dry_run_shows_the_blas_line_and_the_rank_env():
    r = subprocess.run([sys.executable, str(ROOT / "launch"), "--dry-run", str(ROOT / "configs" / "demo.yaml")],
                       env=_clean_env(OPENBLAS_CORETYPE="Haswell"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^launch: BLAS: OpenBLAS [\d.]+ core Haswell: [\d.]+ GFLOP/s", r.stderr, re.M), r.stderr
    assert f"  LD_PRELOAD={blas.find_openblas()}" in r.stdout.splitlines()
    assert "  OPENBLAS_CORETYPE=Haswell" in r.stdout.splitlines()
    assert re.search(r"^  DTRAIN_BLAS=openblas,[\d.]+,Haswell,[\d.]+$", r.stdout, re.M), r.stdout


@chooses_a_blas
def test_dtrain_train_prints_the_blas_line_unless_a_launcher_did():
    args = [sys.executable, "-m", "dtrain", "train", "--data.demo_pairs", "4", "--model.path", "/nonexistent/model"]
    r = subprocess.run(args, env=_clean_env(), capture_output=True, text=True, timeout=300)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and lines[0].startswith("dtrain: BLAS: ") and "GFLOP/s" in lines[0], r.stderr
    assert lines[-1].startswith("dtrain: error: ") and "/nonexistent/model" in lines[-1]
    env, _ = blas.blas_env(_clean_env())
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "BLAS" not in r.stderr, r.stderr
