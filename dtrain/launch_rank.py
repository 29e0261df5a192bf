"""The process the launcher starts on every rank: ``python -m dtrain.launch_rank -- CMD ...``.

It runs ``CMD`` (``dtrain train ...``) as a child in its own session, passes
its stdout through, copies its stderr through while keeping the last lines,
forwards SIGINT/SIGTERM to it (SIGHUP, from a closed ssh session, as SIGTERM),
kills it ``DTRAIN_STOP_TIMEOUT`` seconds (default 30) after the first signal if
it is still running, and at exit writes one report line to stderr::

    \\x1edtrain-rank {"rank": 1, "code": 2, "tail": ["...", "dtrain: error: ..."]}

The launcher reads these lines to decide its exit status and to show a failed
rank's last lines. It exists because ``mlx.launch`` exits 0 even when a rank
fails (mlx 0.32: ``_launch_with_io`` only logs a warning) and mixes the ranks'
output without saying which rank wrote what.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import subprocess
import sys
import time

MARK = "\x1edtrain-rank "
TAIL_LINES = 15


def rank_from_env(env=os.environ) -> int:
    """This process's rank as the launchers set it (mlx.launch, OpenMPI), 0 if none."""
    for key in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


def report_line(rank: int, code: int, tail: list) -> str:
    return MARK + json.dumps({"rank": rank, "code": code, "tail": tail}) + "\n"


def parse_report(line: str):
    """``(rank, code, tail)`` from a report line, or None for any other line."""
    if not line.startswith(MARK):
        return None
    try:
        d = json.loads(line[len(MARK):])
        return int(d["rank"]), int(d["code"]), list(d["tail"])
    except (ValueError, KeyError, TypeError):
        return None


def run(cmd: list) -> int:
    """Run ``cmd``, relay its output and signals, report; returns its exit code."""
    rank = rank_from_env()
    stop_timeout = float(os.environ.get("DTRAIN_STOP_TIMEOUT", "120"))
    deadline: list = []
    started: list = []

    def forward(signum, _frame):
        if not deadline:
            deadline.append(time.monotonic() + stop_timeout)
        for proc in started:
            try:
                proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)
            except ProcessLookupError:
                pass

    # Handlers first: the launcher may start us with these signals ignored, and
    # an ignored signal stays ignored across exec; a handled one resets to default.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, start_new_session=True)
    started.append(proc)
    if deadline:  # a signal came while starting
        forward(signal.SIGTERM, None)
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    partial, fd = b"", proc.stderr.fileno()
    while True:
        if deadline and time.monotonic() > deadline[0] and proc.poll() is None:
            proc.kill()
        if not select.select([fd], [], [], 0.5)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        _write(chunk)
        *lines, partial = (partial + chunk).replace(b"\r", b"\n").split(b"\n")
        tail.extend(x.decode(errors="replace")[:300] for x in lines if x.strip())
    if partial.strip():
        tail.append(partial.decode(errors="replace")[:300])
    code = proc.wait()
    sys.stdout.flush()
    _write(report_line(rank, code, list(tail)).encode())
    return code if code >= 0 else 128 - code


def _write(data: bytes) -> None:
    """Write to stderr; a closed terminal (ssh hung up) must not stop the relay."""
    try:
        sys.stderr.buffer.write(data)
        sys.stderr.buffer.flush()
    except OSError:
        pass


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m dtrain.launch_rank -- COMMAND ...", file=sys.stderr)
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
