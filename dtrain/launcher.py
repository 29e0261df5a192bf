"""``./launch``: run a training job on one rank, N local ranks, several hosts or MPI.

    ./launch CONFIG [--section.key VALUE ...]          one rank, no distributed setup
    ./launch -n N CONFIG                                N ranks on loopback (mlx.launch, ring)
    ./launch --hostfile HOSTS.json CONFIG               one rank per host (mlx.launch: ring, jaccl, nccl)
    ./launch -n N --backend mpi CONFIG                  mpirun directly
    ./launch --dry-run ... / --tensorboard [PORT] ...   print the plan / serve TensorBoard

Every rank gets its environment explicitly (dtrain.launch_plan) and runs
under dtrain.launch_rank, which reports its exit code and last lines; the
launcher exits non-zero when any rank failed and shows that rank's lines.
SIGINT/SIGTERM go to every rank; ranks still alive after ``--stop-timeout``
seconds are killed. Under MPI, mpirun handles the signal itself: it stops the
rank wrappers and exits while the trainers finish saving on their own (a few
seconds later). User errors print one line ``launch: error: ...``, exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .errors import UserError
from .launch_hosts import BACKENDS, LaunchError, load_hostfile
from .launch_plan import build_plan, describe
from .launch_rank import MARK, parse_report

TB_DEFAULT_PORT = 6006


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch", description="Run a dtrain job on one or more ranks. "
                                "Config keys are overridden with --section.key VALUE.")
    p.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    p.add_argument("-n", "--ranks", type=int, default=1, help="ranks on this machine (ring on loopback unless --backend)")
    p.add_argument("--hostfile", help="mlx.launch JSON hostfile: one rank per host")
    p.add_argument("--backend", choices=BACKENDS, help="default: the hostfile's, then the config's, then ring")
    p.add_argument("--port", type=int, default=32323, help="first ring/JACCL port, or the NCCL port (default 32323)")
    p.add_argument("--tensorboard", type=int, nargs="?", const=TB_DEFAULT_PORT, metavar="PORT",
                   help=f"serve TensorBoard on 127.0.0.1:PORT (default {TB_DEFAULT_PORT}) while the run lasts")
    p.add_argument("--stop-timeout", type=float, default=120.0,
                   help="seconds ranks get to stop after Ctrl-C/SIGTERM (a step or an evaluation must finish first)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and start nothing")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--section.key VALUE`` overrides (a dot in the flag) from launcher options.

    ``--tensorboard`` followed by something other than a port number takes the
    default port, so ``--tensorboard CONFIG`` reads as meant.
    """
    options, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            take = 1 if "=" in arg or i + 1 == len(argv) else 2
            overrides += argv[i : i + take]
            i += take
            continue
        options.append(arg)
        if arg == "--tensorboard" and not (i + 1 < len(argv) and argv[i + 1].isdigit()):
            options[-1] = f"--tensorboard={TB_DEFAULT_PORT}"
        i += 1
    return options, overrides


def start_tensorboard(logdir: Path, port: int, log_path: Path) -> subprocess.Popen:
    """Serve ``logdir`` on 127.0.0.1:``port`` with the ``tensorboard`` package.

    Raises:
        LaunchError: the package is missing or the port is taken.
    """
    if importlib.util.find_spec("tensorboard") is None:
        raise LaunchError("--tensorboard needs the tensorboard package: pip install tensorboard (or pip install -e '.[dev]')")
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise LaunchError(f"--tensorboard: port {port} on 127.0.0.1 is in use; pass another, e.g. --tensorboard {port + 1}") from None
    logdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
           "--port", str(port), "--reload_interval", "5"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def stop(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """Terminate a helper process and its group; kill it after ``timeout`` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def relay_stderr(stream, reports: list) -> None:
    """Copy the ranks' stderr to ours, taking out rank reports (launch_rank.MARK lines)."""
    mark, buf, out = MARK.encode(), b"", sys.stderr.buffer
    for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            report = parse_report(line.decode(errors="replace"))
            if report is None:
                out.write(line + b"\n")
            else:
                reports.append(report)
        if buf and mark[:1] not in buf:  # progress bars end in \r, not \n: pass them on now
            out.write(buf)
            buf = b""
        out.flush()
    if buf:
        out.write(buf)
        out.flush()


def run_plan(plan, stop_timeout: float) -> int:
    """Start ``plan.command`` in its own session, relay signals, summarize ranks.

    Returns the launcher's exit status: 0 when every rank reported success,
    the failed rank's code (or 1) otherwise, 128+signal after Ctrl-C/SIGTERM.
    """
    for path, content in plan.files.items():
        Path(path).write_text(content)
    env = {**os.environ, **plan.explicit, "DTRAIN_STOP_TIMEOUT": str(stop_timeout)}
    # mlx.launch must outlive the ranks to relay their last lines, so it ignores
    # the signals (inherited SIG_IGN); mpirun handles them itself.
    shield = plan.backend not in ("mpi",)
    proc = subprocess.Popen(plan.command, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_ignore_stop_signals if shield else None)
    reports: list = []
    relay = threading.Thread(target=relay_stderr, args=(proc.stderr, reports), daemon=True)
    relay.start()
    got: list = []

    def on_signal(signum, _frame):
        if got:  # a second Ctrl-C: stop waiting
            _killpg(proc.pid, signal.SIGKILL)
            return
        got.append(signum)
        print(f"launch: {signal.Signals(signum).name}: stopping {plan.world_size} rank(s) "
              f"(up to {stop_timeout:g} s)", file=sys.stderr, flush=True)
        _killpg(proc.pid, signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while proc.poll() is None:
            time.sleep(0.1)
        relay.join(timeout=5)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return summarize(plan.world_size, reports, proc.returncode, got[0] if got else None)


def _ignore_stop_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def summarize(world_size: int, reports: list, launcher_code: int, stopped_by) -> int:
    """Print what went wrong, if anything, and return the exit status."""
    codes = {rank: (code, tail) for rank, code, tail in reports}
    killed = {-signal.SIGTERM, -signal.SIGINT, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGINT}
    failed = [r for r in sorted(codes) if codes[r][0] != 0 and codes[r][0] not in killed]
    for r in failed:
        code, tail = codes[r]
        print(f"launch: rank {r} failed with exit code {code}; its last lines:", file=sys.stderr)
        for line in tail[-10:]:
            print(f"  [rank {r}] {line}", file=sys.stderr)
    stopped = [r for r in sorted(codes) if codes[r][0] in killed]
    if stopped:
        print(f"launch: rank(s) {', '.join(map(str, stopped))} stopped by a signal", file=sys.stderr)
    missing = [r for r in range(world_size) if r not in codes]
    if missing and not stopped_by:
        print(f"launch: rank(s) {', '.join(map(str, missing))} did not report an exit status "
              f"(launcher exit code {launcher_code})", file=sys.stderr)
    if stopped_by:
        return 128 + stopped_by
    if failed:
        return codes[failed[0]][0] if codes[failed[0]][0] > 0 else 1
    if stopped:
        return 1
    if missing or launcher_code != 0:
        return launcher_code or 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``./launch``; returns the exit status."""
    from .cli import split_overrides
    from .config import load_config

    options, extra = split_argv(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(options)
    tb = None
    try:
        if args.ranks < 1:
            raise LaunchError(f"-n must be at least 1; got {args.ranks}")
        overrides = split_overrides(extra)
        cfg = load_config(args.config, overrides)
        hostfile = load_hostfile(args.hostfile) if args.hostfile else None
        with tempfile.TemporaryDirectory(prefix="dtrain-launch-") as tmp:
            args.tmpdir = tmp
            plan = build_plan(args, cfg, overrides, hostfile)
            for line in plan.notes:
                print(f"launch: {line}", file=sys.stderr, flush=True)
            if args.dry_run:
                print(describe(plan), flush=True)
                return 0
            if args.tensorboard is not None:
                logdir = Path(cfg.train.output_dir) / "tb"
                tb = start_tensorboard(logdir, args.tensorboard, Path(tmp) / "tensorboard.log")
                print(f"launch: TensorBoard at http://127.0.0.1:{args.tensorboard}/ (logdir {logdir})", flush=True)
            try:
                return run_plan(plan, args.stop_timeout)
            finally:
                if tb is not None:
                    _stop_tensorboard(tb, Path(tmp) / "tensorboard.log")
    except UserError as err:
        print(f"launch: error: {err}", file=sys.stderr)
        return 2


def _stop_tensorboard(tb: subprocess.Popen, log_path: Path) -> None:
    if tb.poll() is not None:
        last = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()][-1:]
        print(f"launch: TensorBoard exited early (code {tb.returncode}): {' '.join(last)}", file=sys.stderr)
        return
    stop(tb)
