"""``./setup`` on macOS, run here under a faked ``uname``/``sysctl``/``sw_vers`` and fake Pythons:
what it accepts, what it prints when something is missing; and shellcheck on the shell scripts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("dirname", "date", "tail", "id", "cat", "sed")  # what ./setup runs besides the fakes


def fake(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)


def mac(tmp_path: Path, pythons: dict, machine: str = "arm64", arm64: str = "1", version: str = "15.2") -> Path:
    """A copy of ./setup in ``tmp_path/repo`` and a PATH folder faking a Mac.

    ``pythons``: name -> ``"3.12 arm64"`` (what python_info prints). The venv's Python is a fake
    that records its arguments and says Metal is available.
    """
    repo, bin_ = tmp_path / "repo", tmp_path / "bin"
    (repo / ".venv" / "bin").mkdir(parents=True)
    bin_.mkdir()
    shutil.copy(ROOT / "setup", repo / "setup")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")  # the extras it names
    for tool in TOOLS:
        (bin_ / tool).symlink_to(shutil.which(tool))
    fake(bin_ / "uname", f'[ "$1" = -m ] && echo {machine} || echo Darwin')
    fake(bin_ / "sysctl", f'[ "$*" = "-n hw.optional.arm64" ] && echo {arm64}')
    fake(bin_ / "sw_vers", f'[ "$1" = -productVersion ] && echo {version}')
    for name, info in pythons.items():
        fake(bin_ / name, f'echo "{info}"')
    fake(repo / ".venv" / "bin" / "python",
         f'echo "$*" >> {tmp_path}/venv-calls; case "$*" in *device_info*|*metal.is_available*) echo True;; esac')
    return repo


def run_setup(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": str(repo.parent / "bin"), "HOME": str(repo.parent), "CI": "true"}
    return subprocess.run(["/bin/bash", str(repo / "setup"), *(args or ("dev",))], env=env, capture_output=True,
                          text=True, timeout=60)


def test_mac_with_a_native_python_installs_the_metal_wheel(tmp_path):
    repo = mac(tmp_path, {"python3": "3.9 arm64", "python3.12": "3.12 arm64"})
    r = run_setup(repo)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "setup: installing dtrain and its dependencies into .venv (pip's output goes to .setup.log)"
    assert lines[1] == "setup: Mac users: run .venv/bin/dtrain doctor first and paste its output into any report"
    assert lines[2].startswith("setup: done in ")
    calls = (tmp_path / "venv-calls").read_text().splitlines()
    assert calls[0] == "-m pip install -q --disable-pip-version-check -e .[dev]"  # pyproject: mlx on darwin
    assert "apt" not in r.stdout + (repo / ".setup.log").read_text()


def test_mac_whose_metal_device_mlx_cannot_open_is_warned_of(tmp_path):
    """A Metal build of MLX says metal available (mlx/backend/metal/metal.cpp: is_available returns true) where
    macOS gives the process no Metal device (a virtual machine, a headless or sandboxed session), and raises at the
    first device call: setup asked is_available and said done without a word. It now opens the device."""
    repo = mac(tmp_path, {"python3.12": "3.12 arm64"})
    fake(repo / ".venv" / "bin" / "python", 'case "$*" in *device_info*) echo "RuntimeError: [metal::load_device] '
         'No Metal device available." >&2; exit 1;; *metal.is_available*) echo True;; esac')
    r = run_setup(repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[1:3] == [
        "setup: warning: MLX installed but cannot open a Metal device (MLX's error is in .setup.log; a virtual "
        "machine or", "setup: a headless or sandboxed session has none): dtrain cannot train here"]
    assert "No Metal device available" in (repo / ".setup.log").read_text()


def test_mac_without_a_usable_python_says_what_to_install(tmp_path):
    """A Python 3.10 was taken, and pip then found no mlx-lm 0.32.2 (it requires Python >= 3.11)."""
    repo = mac(tmp_path, {"python3": "3.9 arm64", "python3.10": "3.10 arm64", "python3.11": "3.11 x86_64"})
    r = run_setup(repo)
    assert r.returncode == 1
    bin_ = tmp_path / "bin"
    assert r.stdout.splitlines() == [
        f"setup: error: dtrain needs a native (arm64) Python >= 3.11; found: {bin_}/python3 (3.9); "
        f"{bin_}/python3.11 (3.11, x86_64: Rosetta); {bin_}/python3.10 (3.10);",
        "setup: install one, then run ./setup again: brew install python@3.12 (Homebrew, https://brew.sh)",
        "setup: or the macOS installer from https://www.python.org/downloads/macos/",
    ]
    assert not (tmp_path / "venv-calls").exists()


def test_mac_with_no_python_at_all(tmp_path):
    r = run_setup(mac(tmp_path, {}))
    assert r.returncode == 1
    assert r.stdout.splitlines()[0] == "setup: error: dtrain needs a native (arm64) Python >= 3.11; found: none"


def test_intel_mac_and_old_macos_are_refused(tmp_path):
    r = run_setup(mac(tmp_path / "intel", {"python3": "3.12 x86_64"}, machine="x86_64", arm64="0"))
    assert (r.returncode, r.stdout) == (1, "setup: error: MLX needs a Mac with Apple silicon (M1 or later); "
                                           "this one is x86_64\n")
    r = run_setup(mac(tmp_path / "old", {"python3": "3.12 arm64"}, version="13.6.1"))
    assert (r.returncode, r.stdout) == (1, "setup: error: MLX needs macOS 14.0 or later; this Mac runs macOS 13.6.1 "
                                           "(System Settings -> Software Update)\n")


def test_a_rosetta_terminal_on_apple_silicon_is_not_an_intel_mac(tmp_path):
    # uname -m says x86_64 under Rosetta; hw.optional.arm64 still says 1, and a native Python is found
    repo = mac(tmp_path, {"python3": "3.13 arm64"}, machine="x86_64", arm64="1")
    assert run_setup(repo).returncode == 0


def test_help_and_an_unknown_extra_install_nothing(tmp_path):
    """``./setup --help`` ran as extras '--help': OpenBLAS from apt, a venv, then pip's 'Invalid requirement';
    ``./setup dve`` (a typo of dev) installed dtrain without the dev tools and said done (pip only warns)."""
    repo = mac(tmp_path, {"python3": "3.12 arm64"})
    r = run_setup(repo, "--help")
    assert r.returncode == 0 and r.stdout.startswith("./setup [EXTRAS]: install dtrain"), r.stdout + r.stderr
    assert "Python >= 3.11" in r.stdout and "set -euo" not in r.stdout
    for args, error in ((("dve",), "setup: error: unknown extra 'dve' (known: mpi, hf, dev, bench)"),
                        (("dev,mpi,gpu",), "setup: error: unknown extra 'gpu' (known: mpi, hf, dev, bench)"),
                        (("dev", "mpi"), "setup: error: give the extras as one argument, e.g. ./setup dev,mpi"),
                        # known names, yet no list pip reads: its parse error after apt-get and a new .venv
                        *(((bad,), f"setup: error: give the extras as names joined by commas, e.g. ./setup dev,mpi "
                                   f"(got '{bad}')") for bad in ("dev mpi", "dev,", ",", "dev,,mpi", "d*"))):
        r = run_setup(repo, *args)
        assert (r.returncode, r.stdout.strip()) == (1, error), r.stderr
    assert not (tmp_path / "venv-calls").exists()  # pip never ran
    assert run_setup(repo, "dev,mpi").returncode == 0
    assert (tmp_path / "venv-calls").read_text().splitlines()[0].endswith("-e .[dev,mpi]")
    assert run_setup(repo, "dev, mpi").returncode == 0  # pip reads spaces after the commas


def test_ci_runs_the_tests_with_ci_set_whatever_started_it(tmp_path):
    """.ci/run on a runner that sets no ``CI`` (Jenkins, a plain shell) ran the property tests at random: the
    conftest's ``ci`` profile (derandomize) loads only with ``CI`` set, as docs/reliability.md says .ci/run runs.
    Here apt-get, sudo, ./setup and the venv's Python are fakes; the fake Python prints what pytest would get."""
    repo, bin_ = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".venv" / "bin").mkdir(parents=True)
    bin_.mkdir()
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    for tool in ("dirname", "id"):
        (bin_ / tool).symlink_to(shutil.which(tool))
    fake(bin_ / "apt-get", "")
    fake(bin_ / "sudo", '"$@"')
    fake(repo / "setup", "")
    fake(repo / ".venv" / "bin" / "python", 'echo "CI=${CI-unset} $*"')
    for given, want in (({}, "true"), ({"CI": "1"}, "1")):  # a runner's own value is kept
        r = subprocess.run(["/bin/bash", str(repo / ".ci" / "run")], env={"PATH": str(bin_), "HOME": str(tmp_path),
                           **given}, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (0, f"CI={want} -m pytest -q\n"), r.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_shell_scripts_pass_shellcheck():
    r = subprocess.run(["shellcheck", "setup", ".ci/run"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ})
    assert r.returncode == 0, r.stdout


# The oldest version of each dependency the suite passed on, in a venv with it pinned: below it dtrain calls
# what the package lacks. gguf 0.17.1: GGUFReader fields' contents(), add_key_value's sub_type (0.17.0's writer
# refuses a key given twice, which test_models_gguf.py writes). pyarrow 20: RecordBatch.to_pylist(maps_as_pydicts).
# The extras' too, with the numpy pip installs beside them (2.x): tensorboard 2.17.1 (older ones use np.string_);
# matplotlib 3.7.3 (3.5 has no wheel for Python 3.11; 3.6-3.7.2 allow numpy 2 but were built for 1.x).
FLOORS = {"gguf": "0.17.1", "pyarrow": "20", "tokenizers": "0.22",  # tokenizers: transformers 5.7 allows no older
          "tensorboard": "2.17.1", "matplotlib": "3.7.3"}


def test_pyproject_floors_are_the_oldest_versions_the_suite_passed_on():
    """pyproject allowed gguf>=0.10, whose reader has no contents(): every GGUF convert and export failed; and
    pyarrow>=15, which has no to_pylist(maps_as_pydicts): every Parquet or Arrow data file failed; and (dev extra)
    tensorboard>=2.14, which with numpy 2 cannot read an event file (np.string_ was removed); and (bench extra)
    matplotlib>=3.5, whose 3.6-3.7.2 wheels for Python 3.11 do not import with numpy 2 (`report --png` failed)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    floors = {}  # name -> each floor it is given (datasets is in two extras)
    for d in deps:
        if ">=" in d:
            floors.setdefault(re.match(r"[\w.-]+", d)[0], set()).add(re.search(r">=([\w.]+)", d)[1])
    assert {name: floors[name] for name in FLOORS} == {name: {floor} for name, floor in FLOORS.items()}
