"""``dtrain doctor``: the lines a report needs, on a (stubbed) Mac and on this machine, and a timed demo run."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from dtrain import doctor
from fixtures_launch import make_model_folder
from test_memory import MACS, stub_device
from waiting import finish, spawn, wait_for_line

ROOT = Path(__file__).resolve().parents[1]


def test_doctor_on_a_16gb_mac_shows_the_working_set_wired_limit_and_budget(monkeypatch):
    # system_lines sets MLX_MPI_LIBNAME where mpirun is installed (as `dtrain doctor` must, before MLX loads an MPI):
    # set here through monkeypatch, it is gone after the test, not left in the environment of every later test
    monkeypatch.setenv("MLX_MPI_LIBNAME", "")
    wired = []
    stub_device(monkeypatch, "metal", MACS[16], active=0, wired=wired)
    lines = doctor.system_lines(None)
    assert lines[3] == "backend: metal (default device Device(gpu, 0); metal available: True, cuda available: False)"
    assert lines[4] == "device: Apple M1 (applegpu_g13g)"
    assert lines[5] == ("device_info: architecture=applegpu_g13g, device_name=Apple M1, max_buffer_length=8589934592, "
                        "max_recommended_working_set_size=11453251584, memory_size=17179869184, resource_limit=499000")
    assert lines[6] == ("recommended working set: 10.67 GiB (11,453,251,584 bytes); "
                        "unified memory: 16.00 GiB (17,179,869,184 bytes)")
    assert lines[7] == "wired limit: 0.00 GiB (0 bytes) now; a training run sets it to the recommended working set"
    assert wired == [0, 0]  # read by setting it and putting the old value back
    assert "auto engine budget (engine.memory_budget_gb: 0): 10.67 GiB (11,453,251,584 bytes)" in lines
    assert not any(x.startswith("BLAS:") for x in lines)  # macOS: MLX's own, nothing to choose


@pytest.mark.parametrize("release, ranks, said", [
    ("15.1", None, "a training run sets it to the recommended working set"),
    ("26.0.1", "2", "a training run sets it to the recommended working set divided by the 2 ranks on this Mac"),
    ("14.6.1", None, "it has no effect on macOS 14.6.1 (MLX wires memory on macOS 15 or later)"),
])
def test_doctor_says_what_a_run_does_with_the_wired_limit_on_this_macos(monkeypatch, release, ranks, said):
    """MLX keeps memory resident through Metal residency sets, which need macOS 15
    (mlx/backend/metal/resident.cpp): on macOS 14 setting the wired limit does nothing. A run
    wires the working set divided by the ranks on the Mac (memory.wired_limit)."""
    monkeypatch.setenv("MLX_MPI_LIBNAME", "")
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(var, raising=False)
    if ranks is None:
        monkeypatch.delenv("DTRAIN_LOCAL_RANKS", raising=False)
    else:
        monkeypatch.setenv("DTRAIN_LOCAL_RANKS", ranks)
    monkeypatch.setattr(platform, "mac_ver", lambda: (release, ("", "", ""), "arm64"))
    stub_device(monkeypatch, "metal", MACS[16], active=0, wired=[])
    lines = doctor.system_lines(None)
    assert f"wired limit: 0.00 GiB (0 bytes) now; {said}" in lines


NO_DEVICE = ("[metal::load_device] No Metal device available. This typically occurs in headless, sandboxed, or "
             "virtualized macOS sessions where the GPU is not accessible.")


def test_doctor_on_a_mac_whose_metal_device_mlx_cannot_open_reports_it(monkeypatch, capsys):
    """A Metal build says metal available and defaults to the GPU even where macOS gives the process no Metal
    device (a virtual machine, a headless or sandboxed session: mlx/backend/metal/device.cpp load_device); its
    first device call raises. Doctor printed its header, then a traceback and no line of the report. It now
    prints the versions, the OS and MLX's message, the distributed backends, and skips the demo run."""
    from dtrain.cli import main

    monkeypatch.setenv("MLX_MPI_LIBNAME", "")
    stub_device(monkeypatch, "metal", MACS[16], wired=[])
    monkeypatch.setattr("platform.system", lambda: "Darwin")  # no BLAS line: MLX's own

    def no_device(*_):
        raise RuntimeError(NO_DEVICE)

    for name in ("device_info", "get_active_memory", "get_memory_limit", "set_wired_limit"):
        monkeypatch.setattr(mx, name, no_device)
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("dtrain: 0.1.0; mlx: ") and lines[3].startswith("os: ")
    assert lines[4] == "backend: metal (default device Device(gpu, 0); metal available: True, cuda available: False)"
    assert lines[5] == f"device: MLX cannot use it: {NO_DEVICE}"
    assert lines[6].startswith("distributed backends in this MLX: ring")
    assert lines[7:] == ["demo run: skipped: MLX cannot use its device (the device line says why)"]


def test_doctor_asks_mlx_about_mpi_with_the_libmpi_launch_passes(tmp_path, monkeypatch):
    """MLX dlopens a bare libmpi.dylib unless MLX_MPI_LIBNAME names one, and Homebrew's is not on
    dyld's path: doctor must ask with the libmpi ./launch gives MPI ranks, or it says 'no mpi'
    on a Mac where ./launch --backend mpi works."""
    lib = tmp_path / "homebrew" / "lib" / "libmpi.40.dylib"
    lib.parent.mkdir(parents=True)
    lib.write_text("")
    tools = {"homebrew/bin/mpirun": "exit 0", "homebrew/bin/ompi_info": "exit 0",
             "tools/otool": f"printf 'ompi_info:\\n\\t{lib} (compatibility version 81.0.0)\\n'"}
    for name, body in tools.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'homebrew' / 'bin'}:{tmp_path / 'tools'}:/usr/bin:/bin")
    monkeypatch.setenv("MLX_MPI_LIBNAME", "")
    stub_device(monkeypatch, "metal", MACS[16], active=0, wired=[])
    monkeypatch.setattr("platform.system", lambda: "Darwin")
    monkeypatch.setattr(mx.distributed, "is_available",  # as MLX's dlopen: only with the name given
                        lambda b: b == "ring" or (b == "mpi" and os.environ.get("MLX_MPI_LIBNAME") == str(lib)))
    line = doctor.system_lines(None)[-1]
    assert line.startswith("distributed backends in this MLX: ring, mpi; ")
    assert line.endswith(f"mpirun: {tmp_path / 'homebrew' / 'bin' / 'mpirun'} (libmpi: {lib})")


def test_doctor_without_demo_on_this_machine():
    r = subprocess.run([sys.executable, "-m", "dtrain", "doctor", "--no-demo"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "dtrain doctor (paste all of it into a report)"
    assert lines[1].startswith(f"dtrain: 0.1.0; mlx: {mx.__version__}; mlx-lm: ")
    assert lines[2] == f"python: {platform.python_version()} ({sys.executable})"
    assert lines[4] == ("backend: metal (default device Device(gpu, 0); metal available: True, cuda available: False)"
                        if mx.metal.is_available() else  # a Mac; else a machine without a GPU (CI, Linux)
                        "backend: cpu (default device Device(cpu, 0); metal available: False, cuda available: False)")
    assert any(x.startswith("auto engine budget (engine.memory_budget_gb: 0): ") for x in lines)
    assert sum(x.startswith("BLAS: ") for x in lines) == (platform.system() == "Linux")
    assert lines[-1].startswith("distributed backends in this MLX: ring")
    assert not any(x.startswith("demo run") for x in lines)


@pytest.mark.parametrize("option, value", [("--steps", 10**22), ("--pairs", 2**62), ("--max-length", 2**63)])
def test_doctor_option_too_large_is_named(option, value, capsys):
    """`dtrain doctor --steps 10**22` printed the system lines, then refused the key 'train.steps', and --pairs 2**62
    'data.demo_pairs' at twice its value: keys no one gave. Each is named as the option, before anything runs."""
    from dtrain.cli import main

    assert main(["doctor", option, str(value)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"dtrain: error: doctor: {option} must be below 2**62; got {value}\n"


def test_doctor_bad_option_is_one_line():
    r = subprocess.run([sys.executable, "-m", "dtrain", "doctor", "--steps", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines()[-1] == "dtrain: error: doctor: --steps and --pairs must be >= 1, --max-length >= 8"


def test_doctor_demo_run_times_each_step(demo_path):
    lines = doctor.demo_lines(steps=2, max_length=64, pairs=2)
    assert lines[0].startswith("demo run: model demo, 2 steps of 2 pairs (<= 64 tokens per side), engine auto (")
    assert [x.split(":")[0] for x in lines[1:]] == ["  step 1", "  step 2", "  peak RSS of this process"]
    for line in lines[1:3]:
        seconds, peak = line.split(": ", 1)[1].split(" s, peak MLX memory ")
        assert float(seconds) > 0 and float(peak.split(" GiB")[0]) > 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_doctor_stopped_during_its_demo_run_says_interrupted_and_leaves_nothing(tmp_path, sig):
    """A stop during the demo run was the run's stop: it saved a checkpoint, said 'continue with
    --train.resume auto' of a folder removed at once, printed the steps done as the report of all
    of them (3000 steps asked, 32 timed) and exited 0. It now ends doctor as any command: 'dtrain:
    interrupted' alone, no demo report, its temporary folder removed, exit status 128 + the signal."""
    model, tmp = make_model_folder(tmp_path / "model"), tmp_path / "tmp"
    tmp.mkdir()
    child = spawn([sys.executable, "-m", "dtrain", "doctor", "--model", model, "--steps", "100000",
                   "--max-length", "64"], tmp_path, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)})
    wait_for_line(child, "step 1: forward+backward")
    child.send_signal(sig)
    code, out, err = finish(child)
    assert code == 128 + sig, err
    assert err.splitlines()[-1] == "dtrain: interrupted"
    assert "--train.resume" not in err and "demo run" not in out
    assert [x for x in os.listdir(tmp) if x != "mlx"] == []  # mlx/: MLX's own cache of compiled kernels


def test_a_stop_swallowed_on_its_way_is_raised_again_at_the_next_step(monkeypatch):
    """The KeyboardInterrupt of a Ctrl-C during the demo run was lost in 1 of 10-20 tries (swallowed in an
    importlib callback): the run trained on and doctor never ended. It is raised again at the next step's edge."""
    from types import SimpleNamespace

    from dtrain.run import trainer

    steps = []

    def fake_train(cfg, hooks):
        run = SimpleNamespace(engine=SimpleNamespace(name="segmented"))
        for step in (1, 2, 3):
            hooks.before_step(step, run)
            if step == 1:
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(1)  # the handler runs here
                except KeyboardInterrupt:
                    pass  # swallowed on its way
            steps.append(step)
            hooks.after_step(step, run)

    monkeypatch.setattr(trainer, "train", fake_train)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        doctor.demo_lines(steps=3)
    assert steps == [1] and signal.getsignal(signal.SIGINT) is before
