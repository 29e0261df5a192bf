"""Two hosts simulated with network namespaces (bench/netns.py): one rank per
namespace with its own IP, ring backend over those IPs, rank and hostfile
given through the environment as mlx.launch gives them to remote hosts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fixtures_launch import free_port, launch, make_job
from waiting import JOB_S
import netns  # bench/netns.py (conftest puts bench/ on the path)
from test_launch import ADAPTER, assert_same_adapter

REASON = netns.can_create_namespaces() if sys.platform == "linux" else "network namespaces are Linux only"
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cannot simulate hosts: {REASON}")


def test_ranks_in_two_namespaces_equal_one_rank(tmp_path):
    config = make_job(tmp_path)
    one = launch(config, "--train.output_dir", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    program = [sys.executable, "-m", "dtrain", "train", "-c", str(config), "--distributed.backend=ring",
               f"--train.output_dir={tmp_path / 'two'}"]
    with netns.namespaces(2) as (names, ips):
        assert ips == ["10.77.0.1", "10.77.0.2"]
        results = netns.run_ranks(names, ips, program, free_port(), timeout=JOB_S)  # a tiny job's bound (waiting.py)
    for r, res in enumerate(results):
        assert res.returncode == 0, (r, res.stderr)
    assert "world size 2" in results[0].stderr
    assert_same_adapter(tmp_path / "one" / ADAPTER, tmp_path / "two" / ADAPTER)


def test_tbf_rate_limit_slows_the_all_reduce():
    """9.77 MB through a 100 Mbit/s link needs at least 782 ms: a floor that load only raises. That the unlimited
    namespaces have no limit is read from their qdisc, not timed: load slowed their all_sum from 64 ms to
    140-260 ms (load 13 on 2 cores), past the floor / 3 this test asked, and before that past "twice as fast"."""
    size = netns.SMOLLM2_LORA_PARAMS
    floor = size * 4 / (100e6 / 8)  # seconds: every byte of the sum crosses each rank's link once (2-rank ring)
    limited = netns.all_sum_seconds(2, "100mbit", [size], iters=3, port=free_port())[size]
    assert limited >= floor * 0.95, (limited, floor)
    assert netns.all_sum_seconds(2, None, [size], iters=3, port=free_port())[size] > 0  # the unlimited sum runs
    for rate, limit in (("100mbit", ["tbf", "rate", "100Mbit"]), (None, [])):  # veth's own qdisc: no rate
        with netns.namespaces(2, rate) as (names, _):
            shown = [subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "eth0"], check=True,
                                    capture_output=True, text=True).stdout.split() for ns in names]
        assert all([w for w in words if w in ("tbf", "rate", "100Mbit")] == limit for words in shown), (rate, shown)
