"""A run's stop request: SIGINT, SIGTERM or SIGHUP asks the run to stop after the step in
progress, which agrees on it across ranks (``step.Step``) before the loop saves."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from typing import Optional

from ..files import to_devnull

# The same stop signal again within this many seconds is the same stop: GNU timeout sends its SIGTERM to the
# process and then to the process's group, microseconds apart; a person's second Ctrl-C comes far later.
REPEAT_S = 0.1


class StopRequest:
    """SIGINT/SIGTERM/SIGHUP set ``requested``; the step in progress agrees on it and the loop saves after it.

    A second Ctrl-C or SIGTERM ends the process at once (killed by it), also inside a long MLX
    call, as a second Ctrl-C to ``./launch`` does; a repeated SIGHUP (a closing terminal may
    send two) does not, nor the same signal again within :data:`REPEAT_S` (GNU timeout's two).
    SIGHUP (the terminal closed) also points stdout and stderr at /dev/null: a write to a
    hung-up terminal fails (EIO), which would end the run before its save.
    Handlers are installed only in the main thread and restored on exit; a stop that the handler they
    replace kept (its ``again``: one whose exception Python ignored) is raised again as they are installed.
    """

    def __init__(self):
        self.requested = False
        self.signal: Optional[int] = None  # the first stop signal this process received itself
        self.agreed = False  # the run stopped by the ranks' agreement (another rank's signal may have come first)
        self.failure: Optional[Exception] = None  # rank 0's write that failed mid-run (fail), raised at the stop
        self._old = {}
        self._wakeup: Optional[tuple] = None  # (the fd signal.set_wakeup_fd had, our pipe's write end)

    def _handle(self, signum, _frame):
        if signum == signal.SIGHUP:
            to_devnull(1, 2)
        self.signal = self.signal or signum
        self.requested = True

    def fail(self, err: Exception) -> None:
        """Rank 0's write failed (a full disk) between two collectives: ask the ranks to stop, as a signal does,
        and keep ``err`` for rank 0 to raise once they agreed. Raised at once, it would leave the others waiting
        in the next collective for a rank that left (a lost peer: exit status 4, which ``--max-restarts`` restarts)."""
        self.failure = self.failure or err
        self.requested = True

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._old[sig] = signal.signal(sig, self._handle)
            # Python runs _handle only when the main thread is back in Python, not inside a long MLX call;
            # the wakeup fd gets each signal's number as it arrives, so a thread can act on the second
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup = (signal.set_wakeup_fd(write), write)
            threading.Thread(target=self._watch, args=(read,), name="dtrain-stop", daemon=True).start()
            # a stop in the run's start-up whose exception Python ignored on its way (the dtrain command's handler
            # keeps its signals: cli._Interrupt) is raised again here, ending the start-up as it should have
            for again in {getattr(h, "again", None) for h in self._old.values()} - {None}:
                again()

    def _watch(self, fd: int) -> None:
        """A SIGINT or SIGTERM after an earlier stop signal ends the process by it at once (its default
        action), also while the main thread is inside a long MLX call and has not run _handle yet;
        the same signal as the one before it within REPEAT_S is that one sent twice."""
        last: Optional[tuple] = None  # (signal number, when read) of the latest stop signal not a repeat
        try:
            while data := os.read(fd, 64):
                now = time.monotonic()
                for signum in data:
                    repeat = last is not None and last[0] == signum and now - last[1] < REPEAT_S
                    if last and not repeat and signum in (signal.SIGINT, signal.SIGTERM):
                        libc = ctypes.CDLL(None)  # signal.signal works in the main thread only
                        libc.signal.argtypes, libc.signal.restype = (ctypes.c_int, ctypes.c_void_p), ctypes.c_void_p
                        libc.signal(signum, None)  # SIG_DFL
                        os.kill(os.getpid(), signum)
                    if not repeat and signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                        last = (signum, now)
        finally:
            os.close(fd)

    def uninstall(self) -> None:
        """Restore the handlers the run found. A run stopped by the ranks' agreement before this rank's own
        signal came (a stop sent to every rank reaches them at different times) keeps one late stop signal
        from ending the process as it exits: it is swallowed, then the old handlers are back."""
        old, self._old = self._old, {}
        late = self.agreed and not self.requested

        def swallow(_signum, _frame):
            for sig, handler in old.items():
                signal.signal(sig, handler)

        for sig, handler in old.items():
            signal.signal(sig, swallow if late else handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._wakeup[0])
            os.close(self._wakeup[1])  # the watching thread reads the end of the pipe and closes it
            self._wakeup = None
