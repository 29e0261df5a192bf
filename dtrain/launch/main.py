"""``./launch``: run a training job on one rank, N local ranks, several hosts or MPI.

    ./launch CONFIG [--section.key VALUE ...]          one rank, no distributed setup
    ./launch -n N CONFIG                                N ranks on loopback (ring), started directly
    ./launch --hostfile HOSTS.json CONFIG               one rank per host (mlx.launch: ring, jaccl, nccl)
    ./launch -n N --backend mpi CONFIG                  mpirun directly
    ./launch --max-restarts 5 ... CONFIG                start the job again when a rank fails
    ./launch --dry-run ... / --tensorboard [PORT] ...   print the plan / serve TensorBoard

Before anything starts, the config, the hostfile and (for runs on this
machine) the data files are checked; a problem is one line
``launch: error: ...`` and exit status 2. Every rank gets its environment
explicitly (:mod:`.plan`) and runs under :mod:`.rank`, which reports how it
ended; the launcher exits non-zero when any rank failed and shows that rank's
exit status and last lines, not blaming the ranks it stopped after it (:mod:`.supervise`).

Ctrl-C/SIGTERM/SIGHUP stops the job for good: every rank saves after its
step; a rank that makes no progress for ``--stop-timeout`` seconds is killed,
and the launcher says what that lost. A second Ctrl-C kills the ranks at once.
When the launcher itself is gone (SIGKILL), every rank on its machine saves and
stops the same way (:mod:`.rank` watches it), and ``--tensorboard``'s server ends.

With ``--max-restarts N`` a failed job (a rank killed or crashed, a lost peer,
the collective watchdog) is stopped, and after ``--restart-delay`` seconds
started again with ``train.resume=auto`` (a run continued from a checkpoint its
``train.resume`` names: that one again until the run has saved), at most N times;
a user error (exit status 2 on any rank) is not restarted, since it would repeat.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Optional

from ..config import load_config
from ..config_text import take_overrides
from ..errors import UserError
from ..files import OutputDir, absent_folders, output_dir_problem, remove_folders, unusable_path
from . import restart
from ..contract import BACKENDS, JOB_VAR, LAUNCHER_VAR, STOP_SIGNALS, STOP_TIMEOUT_VAR, TB_RUN_VAR
from .hosts import LaunchError, load_hostfile
from .plan import DEFAULT_PORT, MAX_RANKS, build_plan, describe, release
from .rank import say
from .supervise import Attempt, Outcome, signal_group

# the launcher's own options (and dtrain's -c, refused by name), which an override's value never is:
# `--train.output_dir --dry-run CONFIG` lacks the value, and must not start a job training into ./--dry-run
OPTIONS = ("-h", "--help", "-n", "--ranks", "--hostfile", "--backend", "--port", "--tensorboard", "--stop-timeout",
           "--max-restarts", "--restart-delay", "--dry-run", "-c", "--config")
TB_DEFAULT_PORT = 6006
# TensorBoard under a watch on the launcher: its stdin is a pipe whose other end only the launcher
# holds (Popen's pipes are not inherited), so EOF there means the launcher is gone, SIGKILL included;
# it then ends its session (the server and its data server), as a rank stops when its launcher is gone.
TB_PROGRAM = """import os, signal, sys, threading, time
def watch():
    while os.read(0, 1):
        pass
    os.killpg(0, signal.SIGTERM)  # TensorBoard's handler exits through atexit: its $TMPDIR/.tensorboard-info file goes
    time.sleep(5)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
sys.argv[0] = "tensorboard"
from tensorboard.main import run_main
run_main()
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch", description="Run a dtrain job on one or more ranks. "
                                "Config keys are overridden with --section.key VALUE.")
    p.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    p.add_argument("-n", "--ranks", type=int, default=1, help="ranks on this machine (ring on loopback unless --backend)")
    p.add_argument("--hostfile", help="mlx.launch JSON hostfile: one rank per host")
    p.add_argument("--backend", choices=BACKENDS, help="default: the hostfile's, then the config's, then ring")
    p.add_argument("--port", type=int, help=f"first ring/JACCL port, or the NCCL port (default: {DEFAULT_PORT}, "
                   "or free ports for ranks on this machine when it is taken; a --hostfile job's restart: random ones)")
    p.add_argument("--tensorboard", type=int, nargs="?", const=TB_DEFAULT_PORT, metavar="PORT",
                   help=f"serve TensorBoard on 127.0.0.1:PORT (default {TB_DEFAULT_PORT}) while the run lasts")
    p.add_argument("--stop-timeout", type=float, default=60.0,
                   help="after Ctrl-C/SIGTERM, kill a rank that has used no CPU for this many seconds "
                        "(a rank finishing its step or saving is never killed; default 60)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="when a rank fails, start the whole job again from its newest checkpoint "
                        "(train.resume=auto), at most this many times (default 0)")
    p.add_argument("--restart-delay", type=float, default=5.0, help="seconds between a failure and the restart (default 5)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and start nothing")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Launcher options and ``section.key=value`` overrides (grammar: ``dtrain.config_text.take_overrides``).

    ``--tensorboard`` followed by something other than a whole number takes the
    default port, so ``--tensorboard CONFIG`` reads as meant (``--tensorboard -1``
    is a port, refused as one).

    Raises:
        ConfigError: an override with no value (at the end, or before one of :data:`OPTIONS`).
    """
    options, overrides = take_overrides(argv, OPTIONS)
    for i, arg in enumerate(options):
        if arg == "--tensorboard" and not (i + 1 < len(options) and options[i + 1].lstrip("+-").isdigit()):
            options[i] = f"--tensorboard={TB_DEFAULT_PORT}"
    return options, overrides


def start_tensorboard(logdir: Path, port: int, log_path: Path) -> subprocess.Popen:
    """Serve ``logdir`` on 127.0.0.1:``port`` with the ``tensorboard`` package, ended when the launcher is
    gone (:data:`TB_PROGRAM`; keep the returned process's ``stdin`` open while it should serve).

    Raises:
        LaunchError: the package is missing, the port is taken or ``logdir`` cannot be created.
    """
    if importlib.util.find_spec("tensorboard") is None:
        raise LaunchError("--tensorboard needs the tensorboard package: pip install tensorboard (or pip install -e '.[dev]')")
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise LaunchError(f"--tensorboard: port {port} on 127.0.0.1 is in use; pass another, e.g. --tensorboard {port + 1}") from None
    made = absent_folders(logdir)
    try:
        logdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LaunchError(output_dir_problem(logdir.parent, err)) from None
    remove_folders(made)  # it could be made; the run makes it (TensorBoard waits): a refused start leaves no folder
    cmd = [sys.executable, "-c", TB_PROGRAM, "--logdir", str(logdir), "--host", "127.0.0.1",
           "--port", str(port), "--reload_interval", "5"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE, start_new_session=True)


def stop_tensorboard(tb: subprocess.Popen, log_path: Path, timeout: float = 5.0) -> None:
    """Stop the TensorBoard server (or say why it ended early)."""
    if tb.poll() is not None:
        last = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()][-1:]
        say(f"launch: TensorBoard exited early (code {tb.returncode}): {' '.join(last)}")
        return
    signal_group(tb.pid, signal.SIGTERM)  # its own session: the server and anything it started
    try:
        tb.wait(timeout)
    except subprocess.TimeoutExpired:
        signal_group(tb.pid, signal.SIGKILL)
        tb.wait()
    tb.stdin.close()


def check_data(cfg) -> None:
    """``data.train`` and ``data.valid`` exist, and a JSONL/JSON file holds something, before any rank starts.

    For runs on this machine (ranks on other hosts read their own files); hub
    dataset ids are left to the ranks (loading one here would download it twice).

    Raises:
        DataError: the first missing, unreadable or empty source (the ranks' own message).
    """
    from ..data.sources import is_hub_id, read_items, resolve

    for spec, role in ((cfg.data.train, "train"), (cfg.data.valid, "valid")):
        if spec is not None and not is_hub_id(spec):
            source = resolve(spec, cfg.data, role)
            if source.kind == "json":
                next(read_items(source), None)  # an empty file raises at its first item


class StopSignals:
    """SIGINT/SIGTERM/SIGHUP (its terminal closed) for the launcher's whole life.

    The first stops the job for good: the running attempt's ranks save and
    stop, and no restart follows (also when it comes during the restart delay).
    The second kills the ranks at once.
    """

    def __init__(self):
        self.received: list[int] = []
        self.attempt: Optional[Attempt] = None
        self.wake = threading.Event()

    def __call__(self, signum, _frame) -> None:
        self.received.append(signum)
        self.wake.set()
        if self.attempt is None:
            return
        if len(self.received) == 1:
            self.attempt.stop(signum)
        else:
            self.attempt.abort(f"{signal.Signals(signum).name} again: ending the ranks now (killed within 3 s)")

    def install(self) -> dict:
        return {s: signal.signal(s, self) for s in STOP_SIGNALS}


def run_job(plan_for, stop_timeout: float, max_restarts: int, restart_delay: float, output_dir: Optional[Path],
            signals: StopSignals, named: Optional[Path] = None) -> int:
    """Run attempts of the job until it succeeds, is stopped, fails for good or runs out of restarts.

    Args:
        plan_for: ``plan_for(resume, restart)`` -> the :class:`~.plan.Plan`; ``resume=True`` adds
            ``train.resume=auto``; ``restart``: not the first attempt (a hostfile job's ports may move).
        output_dir: the run's output folder when it is on this machine, else None.
        named: the checkpoint folder ``train.resume`` names (not ``auto``), with ``output_dir``: a restart
            continues it again until the run has saved a checkpoint (the newest one until then is of
            the steps the run left, which its first save prunes).
    Returns:
        The launcher's exit status.
    """
    restarts, auto, tb_run = 0, False, None
    at_launch = restart.newest_manifest(output_dir) if named is not None else None
    runs_at_launch = restart.tensorboard_runs(output_dir) if output_dir is not None else set()
    while True:
        plan = plan_for(auto, restarts > 0)
        if tb_run is not None:  # rank 0 continues the failed attempt's TensorBoard run from step 0
            plan = replace(plan, explicit={**plan.explicit, TB_RUN_VAR: str(tb_run)})
        attempt = Attempt(plan, stop_timeout)
        signals.attempt = attempt
        if signals.received:  # it came before this attempt's ranks started (config, plan; a restart's delay)
            return _stopped_before_start(signals, restarts)
        try:
            outcome = attempt.run()
        finally:
            signals.attempt = None
        again = named if named is not None and restart.newest_manifest(output_dir) == at_launch else None
        if outcome.stopped_by is not None:
            _say_what_was_lost(outcome, output_dir, again)
            return outcome.code
        if not outcome.restartable or restarts >= max_restarts:
            if max_restarts and outcome.code != 0:
                why = ("a rank reported a user error, which a restart would repeat" if outcome.user_error
                       else f"all {max_restarts} restart(s) used")
                say(f"launch: not restarting: {why}")
            return outcome.code
        restarts, auto = restarts + 1, again is None
        point = restart.resume_point(output_dir, again) if output_dir is not None else None
        began = restart.tensorboard_runs(output_dir) - runs_at_launch if output_dir is not None else set()
        tb_run = next(iter(began)) if point is None and len(began) == 1 else None
        if point is not None:
            where = f"resuming from step {point.step} ({point.path})"
        elif output_dir is not None:
            where = "starting from step 0 (no checkpoint yet)"
        else:
            where = "resuming from rank 0's newest checkpoint"
        text = f"restart {restarts} of at most {max_restarts}: {outcome.cause()}; {where}"
        say(f"launch: {text}; starting again in {restart_delay:g} s")
        restart.record(point, text)
        if signals.wake.wait(restart_delay):
            return _stopped_before_start(signals, restarts)


def _stopped_before_start(signals: StopSignals, restarts: int = 0) -> int:
    """Say that a stop came before any rank started (during the restart delay after ``restarts``); the exit status."""
    name = signal.Signals(signals.received[0]).name
    say(f"launch: {name} during the restart delay: not restarting" if restarts else
        f"launch: {name}: stopped before any rank started")
    return 128 + signals.received[0]


def _say_what_was_lost(outcome: Outcome, output_dir: Optional[Path], named: Optional[Path]) -> None:
    rank0 = outcome.reports.get(0)
    if rank0 is not None and rank0.code == 0 and rank0.killed is None:
        return  # rank 0 finished its save (or had nothing left to do)
    say(f"launch: rank 0 did not save: {restart.describe_loss(output_dir, named)}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``./launch``; returns the exit status."""
    signals = StopSignals()
    previous = signals.install()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # ./launch blocks them while its modules load
    tb, port_locks = None, []
    try:
        options, overrides = split_argv(sys.argv[1:] if argv is None else argv)
        if any(o in ("-c", "--config") or o.startswith(("-c=", "--config=")) for o in options):  # dtrain's form
            raise LaunchError("./launch takes the config file bare, without -c/--config: ./launch [options] CONFIG")
        args = _parser().parse_args(options)
        if args.ranks < 1:
            raise LaunchError(f"-n must be at least 1; got {args.ranks}")
        if args.ranks > MAX_RANKS:  # else the plan's lists of a host and an environment per rank run out of memory
            raise LaunchError(f"-n must be at most {MAX_RANKS} (each rank on this machine listens on TCP ports of "
                              f"its own); got {args.ranks}")
        if args.max_restarts < 0 or args.restart_delay < 0 or args.stop_timeout <= 0:
            raise LaunchError("--max-restarts and --restart-delay must be >= 0, --stop-timeout > 0")
        for name, seconds in (("--restart-delay", args.restart_delay), ("--stop-timeout", args.stop_timeout)):
            if not math.isfinite(seconds):  # inf overflows Event.wait, nan passes every bound above
                raise LaunchError(f"{name} must be a finite number of seconds; got {seconds}")
        if args.restart_delay > threading.TIMEOUT_MAX:  # so does a finite wait past it (1e300), after a failure
            raise LaunchError(f"--restart-delay must be at most {threading.TIMEOUT_MAX:.0f} seconds (the longest "
                              f"wait Python's threads take); got {args.restart_delay:g}")
        for name, port in (("--port", args.port), ("--tensorboard", args.tensorboard)):
            if port is not None and not 1 <= port <= 65535:  # else socket.bind raises OverflowError
                raise LaunchError(f"{name} must be a TCP port, 1-65535; got {port}")
        if args.hostfile == "":  # else read as no --hostfile: a job of one rank here (--hostfile "$UNSET")
            raise LaunchError("the hostfile path is empty (''); give a JSON hostfile, or leave --hostfile out to run "
                              "on this machine")
        cfg = load_config(args.config, overrides)
        if args.hostfile:  # --hostfile=~/h.json reaches here unexpanded, and mlx.launch is given the path
            args.hostfile = os.path.expanduser(args.hostfile)
        hostfile = load_hostfile(args.hostfile) if args.hostfile else None
        with tempfile.TemporaryDirectory(prefix="dtrain-launch-") as tmp:
            def plan_for(resume: bool, again: bool = False):
                extra = ["train.resume=auto"] if resume else []
                release(port_locks)  # the previous attempt's ports: its ranks have ended
                return build_plan(args.config, [*overrides, *extra], cfg, ranks=args.ranks, backend=args.backend,
                                  port=args.port, hostfile=hostfile, hostfile_path=args.hostfile, tmpdir=tmp,
                                  port_locks=port_locks, restart=again)

            plan = plan_for(False)
            if args.tensorboard in plan.ports:  # else the rank that listens on it fails to join its group
                span = f"{plan.ports[0]}" + (f"-{plan.ports[-1]}" if len(plan.ports) > 1 else "")
                raise LaunchError(f"--tensorboard {args.tensorboard} is one of the ranks' ports ({span}); pass "
                                  f"another --tensorboard, or another --port")
            if plan.local:
                check_data(cfg)
            for line in plan.notes:
                say(f"launch: {line}")
            if signals.received:  # it came while the config was read or the job planned: no plan shown, no TensorBoard
                return _stopped_before_start(signals)
            if args.dry_run:
                say(describe(plan, {STOP_TIMEOUT_VAR: str(args.stop_timeout),  # as supervise.Attempt passes them
                                    LAUNCHER_VAR: f"{socket.gethostname()}:<launcher-pid>", JOB_VAR: "<job-id>"}),
                    sys.stdout)
                return 0
            if args.tensorboard is not None:
                logdir = OutputDir(Path(cfg.train.output_dir)).tb
                tb = start_tensorboard(logdir, args.tensorboard, Path(tmp) / "tensorboard.log")
                say(f"launch: TensorBoard at http://127.0.0.1:{args.tensorboard}/ (logdir {logdir})", sys.stdout)
            try:
                output_dir = OutputDir(Path(cfg.train.output_dir)).root if plan.local else None
                named = restart.named_checkpoint(cfg.train.resume) if output_dir else None
                return run_job(plan_for, args.stop_timeout, args.max_restarts, args.restart_delay, output_dir, signals,
                               named)
            finally:
                if tb is not None:
                    stop_tensorboard(tb, Path(tmp) / "tensorboard.log")
    except UserError as err:
        say(f"launch: error: {err}")
        return 2
    except OSError as err:  # a path given longer than a file name may be, wherever it is first looked at (as dtrain)
        if err.errno != errno.ENAMETOOLONG:
            raise
        say(f"launch: error: {unusable_path(str(err.filename), err)}")
        return 2
    finally:
        release(port_locks)
        for s, h in previous.items():
            signal.signal(s, h)
