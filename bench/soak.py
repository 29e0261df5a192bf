"""Is the test suite steady? Run CI's script N times in fresh clones, K CPU hogs beside it.

    python bench/soak.py --runs 5 --hogs 2                  # issue 29's proof: expect 0 failures
    python bench/soak.py --runs 1 --hogs 0 -- tests/test_waiting.py   # a quick try on a subset

Each run clones this repository at ``--ref`` (default HEAD: commit first) into a
fresh folder and runs ``.ci/run`` there (apt packages, ``./setup dev,mpi``, then
the README's test command ``.venv/bin/python -m pytest -q``; ``../shared`` beside
the clone when this checkout has one, as in CI), with
``PYTEST_ADDOPTS`` adding ``--durations`` and a JUnit report (and the test paths
after ``--``, for a subset). ``--hogs`` processes spin a core each for the
whole run. Prints each run's status and wall time, every failed test with the
runs it failed in, and the slowest tests (longest of the runs); writes the
whole record as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from prelude import RESULTS, ROOT, write_results

HOG = "while True: pass"


def run_once(ref: str, index: int, work: Path, paths: list[str], durations: int, apt: bool) -> dict:
    """Clone, run .ci/run, and read its JUnit report: ``{"code", "seconds", "failed": [...], "times": {...}}``."""
    clone = work / f"run{index}"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", ref], check=True)
    report = work / f"run{index}.xml"
    addopts = f"--durations={durations} --junitxml={report} -p no:cacheprovider {' '.join(paths)}".strip()
    log = work / f"run{index}.log"
    start = time.monotonic()
    with open(log, "wb") as out:
        # without apt: .ci/run's other two lines, the README's setup and test command
        command = [str(clone / ".ci" / "run")] if apt else ["bash", "-c", "./setup dev,mpi && .venv/bin/python -m pytest -q"]
        code = subprocess.run(command, cwd=clone, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "CI": "true", "PYTEST_ADDOPTS": addopts}).returncode
    seconds = time.monotonic() - start
    failed, times = [], {}
    if report.is_file():
        for case in ET.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            times[name] = float(case.get("time") or 0)
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(name)
    return {"code": code, "seconds": seconds, "failed": failed, "times": times, "log": str(log)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="fresh clones, one after another (default 5)")
    p.add_argument("--hogs", type=int, default=2, help="processes spinning a core each beside every run (default 2)")
    p.add_argument("--hog-session", choices=("own", "soak"), default="own",
                   help="own (default): each hog in a session of its own, as another program's; soak: the hogs in "
                        "this script's session, where autogroup scheduling pits them against the tests' "
                        "threads one by one (docs/reliability.md: which slows the suite more)")
    p.add_argument("--ref", default="HEAD", help="commit to test (default HEAD)")
    p.add_argument("--durations", type=int, default=25, help="slowest tests pytest lists per run (default 25)")
    p.add_argument("--out", default=str(RESULTS / "soak.json"), help="JSON record")
    p.add_argument("--keep", action="store_true", help="keep the clones and logs (printed folder)")
    p.add_argument("--no-apt", action="store_true", help="skip .ci/run's apt-get (packages already installed)")
    p.add_argument("paths", nargs="*", help="after --: test paths for a subset (default: the whole suite)")
    args = p.parse_args(argv)
    ref = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.ref], capture_output=True, text=True,
                         check=True).stdout.strip()
    load = os.getloadavg()
    print(f"soak: {args.runs} run(s) of .ci/run at {ref[:12]}, {args.hogs} hog(s) (session: {args.hog_session}), "
          f"{os.cpu_count()} CPU(s), load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start", flush=True)
    work = Path(tempfile.mkdtemp(prefix="dtrain-soak-"))
    if (ROOT.parent / "shared").is_dir():  # CI has ../shared beside its clone: the tests on real pairs run
        (work / "shared").symlink_to(ROOT.parent / "shared")
    runs = []
    for i in range(args.runs):
        # own (default): a session each, as another program's. Under Linux's autogroup scheduling a hog in
        # this session takes its CPU from this session's share only, never from ranks in sessions of their own
        own = args.hog_session == "own"
        hogs = [subprocess.Popen([sys.executable, "-c", HOG], start_new_session=own) for _ in range(args.hogs)]
        try:
            result = run_once(ref, i, work, args.paths, args.durations, not args.no_apt)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        runs.append(result)
        print(f"run {i + 1}: exit status {result['code']}, {result['seconds']:.0f} s, "
              f"{len(result['times'])} tests, {len(result['failed'])} failed", flush=True)
    failures: dict = {}
    for i, r in enumerate(runs):
        for name in r["failed"]:
            failures.setdefault(name, []).append(i + 1)
    print(f"\nfailures per test ({sum(len(v) for v in failures.values())} in {args.runs} run(s)):")
    for name, which in sorted(failures.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(which)}/{args.runs}  {name}  (run {', '.join(map(str, which))})")
    if not failures:
        print("  none")
    longest: dict = {}
    for r in runs:
        for name, t in r["times"].items():
            longest[name] = max(t, longest.get(name, 0.0))
    print("\nslowest tests (longest of the runs):")
    for name, t in sorted(longest.items(), key=lambda kv: -kv[1])[: args.durations]:
        print(f"  {t:7.1f} s  {name}")
    walls = [r["seconds"] for r in runs]
    print(f"\nwall time per run: {', '.join(f'{w:.0f}' for w in walls)} s")
    record = Path(args.out)
    write_results(record.stem, {"ref": ref, "runs": args.runs, "hogs": args.hogs, "hog_session": args.hog_session,
                                "paths": args.paths, "load_at_start": load, "results": runs},
                  record.parent, stamp=False)
    print(f"record: {args.out}" + (f"; clones and logs in {work}" if args.keep else ""))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not failures and all(r["code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
