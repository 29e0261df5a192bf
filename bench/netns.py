"""Several hosts simulated on one Linux machine, one network namespace per rank, and
the all-reduce time between them.

    python bench/netns.py                      # all-reduce time at 1 and 10 Gbit/s and unlimited
    python bench/netns.py --rates 1gbit --sizes 2442240 --iters 10

Each rank gets a namespace with its own IP (10.77.0.R+1/24) on a veth pair
whose other end sits on a bridge in a hub namespace; ``tc ... tbf`` on each
rank's end limits what it sends. Ranks get their rank and ring hostfile through
the environment (``MLX_RANK``, ``MLX_HOSTFILE``), as mlx.launch gives them to
remote hosts over ssh. Needs root and iproute2. Not part of dtrain: used by
endurance.py, scaling.py and tests/test_launch_netns.py, and run as a script.

The command line's payload default is the LoRA gradient of SmolLM2-135M (30
layers, rank 8 on all 7 linear layers: 2,442,240 float32 = 9.8 MB), the one
``all_sum`` per step of dtrain's trainer (one 32 MiB bucket), plus the step's
scalar metrics.
"""


from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager

from prelude import ROOT  # the ranks run from the repository root, as ./launch starts them

from dtrain.contract import ring_hostfile
from dtrain.launch.plan import base_env

# the LoRA gradient of SmolLM2-135M (30 layers, rank 8 on all 7 linear layers): 2,442,240 float32
SMOLLM2_LORA_PARAMS = 30 * 8 * (2 * 1152 + 2 * 768 + 3 * 2112)
TBF = "burst {burst} latency 400ms"  # burst 32kbit = a 4 KB bucket

ALL_SUM_PROGRAM = r"""
import json, sys, time
import mlx.core as mx
g = mx.distributed.init(strict=True, backend="ring")
out = {}
for size in json.loads(sys.argv[1]):
    x = mx.ones((size,), dtype=mx.float32)
    for _ in range(2):
        mx.eval(mx.distributed.all_sum(x, group=g))
    times = []
    for _ in range(int(sys.argv[2])):
        t0 = time.perf_counter()
        y = mx.distributed.all_sum(x, group=g)
        mx.eval(y)
        times.append(time.perf_counter() - t0)
    assert float(y[0]) == g.size()
    out[size] = sorted(times)[len(times) // 2]
if g.rank() == 0:
    print(json.dumps(out))
"""


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def can_create_namespaces() -> str | None:
    """None when namespaces and veth pairs can be made here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"dtprobe{os.getpid()}"
    try:
        sh("ip", "netns", "add", name)
        sh("ip", "netns", "del", name)
    except FileNotFoundError:
        return "iproute2 ('ip') is not installed"
    except subprocess.CalledProcessError as err:
        return f"'ip netns add' failed: {err.stderr.strip()}"
    return None


@contextmanager
def namespaces(n: int, rate: str | None = None, burst: str = "32kbit"):
    """Create ``n`` rank namespaces on one bridge; yields their IPs; removes them after.

    ``rate``: tbf rate on each rank's egress (e.g. ``1gbit``), None for unlimited;
    ``burst``: tbf bucket size.
    """
    tag = f"dt{os.getpid() % 100000}"
    hub, names = f"{tag}hub", [f"{tag}r{r}" for r in range(n)]
    ips = [f"10.77.0.{r + 1}" for r in range(n)]
    try:
        sh("ip", "netns", "add", hub)
        sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", hub, "link", "set", "br0", "up")
        for r, ns in enumerate(names):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", f"{tag}a{r}", "netns", ns, "type", "veth", "peer", "name", f"{tag}b{r}", "netns", hub)
            sh("ip", "-n", ns, "link", "set", f"{tag}a{r}", "name", "eth0")
            sh("ip", "-n", ns, "addr", "add", f"{ips[r]}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", hub, "link", "set", f"{tag}b{r}", "master", "br0", "up")
            if rate:
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, *TBF.format(burst=burst).split())
        yield names, ips
    finally:
        for ns in [*names, hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_ranks(names: list, ips: list, program: list, port: int, timeout: float = 120) -> list:
    """Run ``program`` once per namespace, rank ``r`` in ``names[r]``; returns the CompletedProcesses.

    Each rank gets ``MLX_RANK`` and ``MLX_HOSTFILE`` (a ring hostfile over
    ``ips``), OpenBLAS and unbuffered output, as ``./launch`` gives them.
    """
    explicit, _ = base_env()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ring_hostfile([[ip] for ip in ips], port), f)
    procs = []
    for r, ns in enumerate(names):
        env = {**os.environ, **explicit, "MLX_RANK": str(r), "MLX_HOSTFILE": f.name}
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *program], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        os.unlink(f.name)


def all_sum_seconds(n: int, rate: str | None, sizes: list, iters: int, port: int = 29500, burst: str = "32kbit") -> dict:
    """Median seconds of one float32 ``all_sum`` of each size over ``n`` namespaced ranks."""
    with namespaces(n, rate, burst) as (names, ips):
        program = [sys.executable, "-c", ALL_SUM_PROGRAM, json.dumps(sizes), str(iters)]
        results = run_ranks(names, ips, program, port)
    for r, res in enumerate(results):
        if res.returncode != 0:
            raise RuntimeError(f"rank {r} failed: {res.stderr.strip().splitlines()[-1:]}")
    return {int(k): v for k, v in json.loads(results[0].stdout.strip().splitlines()[-1]).items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--ranks", type=int, default=2)
    p.add_argument("--rates", default="1gbit,10gbit,none", help="tbf rates, comma separated; none = unlimited")
    p.add_argument("--sizes", default=f"{SMOLLM2_LORA_PARAMS},16", help="float32 elements per all_sum")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--burst", default="32kbit", help="tbf burst (bucket size); 32kbit is 4 KB")
    args = p.parse_args()
    reason = can_create_namespaces()
    if reason:
        print(f"netns: cannot run: {reason}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{args.ranks} ranks, ring backend, one namespace each, tbf burst {args.burst}; median of {args.iters} all_sum calls")
    print(f"{'link':>8} {'elements':>10} {'MB':>7} {'ms':>9} {'MB/s':>8}")
    for rate in args.rates.split(","):
        res = all_sum_seconds(args.ranks, None if rate == "none" else rate, sizes, args.iters, burst=args.burst)
        for size, sec in res.items():
            mb = size * 4 / 1e6
            print(f"{rate:>8} {size:>10} {mb:>7.2f} {sec * 1e3:>9.2f} {mb / sec:>8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
