"""All-reduce time between simulated hosts (network namespaces, dtrain/launch/netns.py).

    python bench/netns.py                      # all-reduce time at 1 and 10 Gbit/s and unlimited
    python bench/netns.py --rates 1gbit --sizes 2442240 --iters 10

The payload default is the LoRA gradient of SmolLM2-135M (30 layers, rank 8 on
all 7 linear layers: 2,442,240 float32 = 9.8 MB), the one ``all_sum`` per step
of dtrain's trainer (one 32 MiB bucket), plus the step's scalar metrics. Needs
root and iproute2.
"""

from __future__ import annotations

import argparse
import sys

import prelude  # noqa: F401  (the repository on sys.path)
from dtrain.launch.netns import SMOLLM2_LORA_PARAMS, all_sum_seconds, can_create_namespaces  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
