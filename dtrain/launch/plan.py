"""What ``./launch`` will run: the command, each rank's environment and shard.

A :class:`Plan` is built without starting anything, from explicit arguments,
so ``--dry-run`` prints exactly what a real launch executes. Ranks on this
machine (``-n N``, ring or NCCL) are started by the launcher itself, each with
the variables of :mod:`dtrain.contract`: mlx.launch 0.32 would sit between,
spinning a core for the whole run (docs/reliability.md). Hostfile runs (ring,
JACCL, NCCL) are started by ``mlx.launch`` over ssh. MPI runs ``mpirun``
directly: mlx.launch passes ``--output :raw``, which OpenMPI 4.1 rejects.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import platform
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from typing import Optional

from ..blas import CHILD_VARS, blas_env
from ..sampler import rank_shard
from ..contract import FILE_VARS, LOCAL_RANKS_VAR, RANK_TMPDIR_VAR, rank_variables
from ..types import example_noun
from .hosts import Hostfile, LaunchError, check_backend

DEFAULT_PORT = 32323  # the first ring/JACCL port, or the NCCL port, unless --port, taken, or a hostfile job's restart
PORT_FLOOR = 20000  # spare ports are drawn from here up to the system's ephemeral range
MAX_RANKS = 65535  # ranks on this machine each listen on ports of their own: past the TCP ports, none could start


@dataclass
class Plan:
    """A launch: ``command`` run in a new session with ``env`` (os.environ + ``explicit``).

    ``rank_env[r]``: the variables rank ``r`` receives beyond the inherited
    environment (what ``--dry-run`` prints): ``explicit``, a hostfile's ``envs``
    (given to the ranks only, as mlx.launch does) and the backend's. ``shards[r]``: pairs per step.
    ``files``: temporary files to write before starting (path -> content), in ``tmpdir``.
    ``local``: every rank runs on this machine (its files are the launcher's files).
    ``ports``: the loopback TCP ports the ranks of a local plan listen on (none for one rank or MPI).
    ``direct``: the launcher starts ``command`` once per rank itself, rank ``r``
    with ``direct[r]`` added (``rank_env[r]`` with files' paths for their
    contents); empty: ``command`` starts every rank (mlx.launch, mpirun) or is the one rank.
    ``command_env``: variables ``command`` itself runs with (``explicit``'s go to the ranks too).
    """

    backend: str
    world_size: int
    hosts: list
    command: list
    explicit: dict
    rank_env: list
    shards: list
    global_batch_pairs: int
    micro_batch_pairs: int
    noun: str = "pair"  # what one training example is called (types.example_noun: "row" under sft)
    local: bool = True
    files: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    direct: list = field(default_factory=list)
    tmpdir: Optional[str] = None
    ports: tuple = ()
    command_env: dict = field(default_factory=dict)


def shard_sizes(global_batch_pairs: int, world_size: int) -> list[int]:
    """Pairs per step on each rank: ``global_batch_pairs`` dealt round-robin (sampler.rank_shard)."""
    batch = list(range(global_batch_pairs))
    return [len(rank_shard(batch, r, world_size)) for r in range(world_size)]


def base_env() -> tuple[dict, list[str]]:
    """Variables every rank gets explicitly, and log lines: the chosen BLAS
    (Linux, ``dtrain.blas.blas_env``), unbuffered output."""
    env, message = blas_env()
    explicit = {k: env[k] for k in CHILD_VARS if k in env}
    explicit["PYTHONUNBUFFERED"] = "1"
    return explicit, [message] if message else []


def hostfile_env(hostfile: Optional[Hostfile]) -> dict:
    """A hostfile's ``envs`` as a dict. mlx.launch 0.32 exports them in each rank's start script (``mpirun
    -x`` for MPI) and not in its own environment, so a PATH meant for the hosts cannot break it here."""
    return dict(e.split("=", 1) for e in (hostfile.envs if hostfile else []))


def rank_program(config: str, overrides: list[str], backend: Optional[str]) -> list[str]:
    """``python -m dtrain.launch.rank -- python -m dtrain train -c CONFIG ...`` (see dtrain.launch.rank)."""
    args = [f"--{o}" for o in overrides]
    if backend:
        args.append(f"--distributed.backend={backend}")
    return [sys.executable, "-m", "dtrain.launch.rank", "--", sys.executable, "-m", "dtrain", "train", "-c", config, *args]


def mlx_launch_path() -> str:
    """The ``mlx.launch`` script next to this interpreter (or on PATH)."""
    local = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    found = local if os.path.exists(local) else shutil.which("mlx.launch")
    if found is None:
        raise LaunchError("mlx.launch not found next to this Python or on PATH; install mlx in this environment")
    return found


def _env_flags(flag: str, env: dict) -> list[str]:
    return [x for k, v in env.items() for x in (flag, f"{k}={v}")]


def _for_ranks(env: dict, here: bool) -> dict:
    """``env`` for ranks on this machine (``here``), else without this machine's BLAS choice
    (``dtrain.blas.CHILD_VARS``: a library path, a core type forced from this CPU's flags): a rank on
    another host chooses its own when it starts (``dtrain.blas.setup``)."""
    return env if here else {k: v for k, v in env.items() if k not in CHILD_VARS}


def command_with_env(plan: Plan, env: dict) -> list[str]:
    """``plan.command`` passing ``env`` to every rank by name (mlx.launch ``--env``, mpirun ``-x``):
    ranks started over ssh, or by mpirun's daemons on other hosts, get no other environment
    from the launcher. Ranks the launcher starts itself (``direct``, one rank) inherit it."""
    if plan.direct or plan.backend == "none" or "--" not in plan.command:
        return list(plan.command)
    at = plan.command.index("--")  # before the rank program
    return [*plan.command[:at], *_env_flags("-x" if plan.backend == "mpi" else "--env", env), *plan.command[at:]]


def _lock_path(port: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"dtrain-port-{port}.lock")


def _is_at(fd: int, path: str) -> bool:
    """Whether ``path`` is the file open as ``fd`` (not removed, nor replaced by another)."""
    try:
        at = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)


def _port_lock(port: int) -> Optional[int]:
    """An exclusive ``flock`` on ``<tmp>/dtrain-port-<port>.lock`` (the fd), or None when another launcher holds it.

    Raises:
        OSError: the file cannot be opened (another user's made under umask 077), created or locked (ENOLCK: a
            file system without locks); its ``filename`` is the lock file, and no fd is left open.
    """
    path = _lock_path(port)
    while True:
        try:  # read-only: flock needs no write access, so another user's lock file (0644) serves as well
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # O_CREAT only then: Linux's protected_regular refuses it on another user's file
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
            os.fchmod(fd, 0o644)  # readable by every user's launcher whatever this one's umask
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as err:  # flock's error names no file
            os.close(fd)
            raise OSError(err.errno, err.strerror, path) from None
        if _is_at(fd, path):
            return fd
        os.close(fd)  # its holder removed it as it released the port (release): lock the path's file now


def release(locks: list) -> None:
    """Release the port locks in ``locks`` (``(port, fd)``, see :func:`free_ports`), emptying the list.

    Each lock file is removed while still locked, so none is left in the temp folder; a launcher that
    opened it just before sees it gone (:func:`_port_lock`). Another user's file in a sticky temp folder
    cannot be removed and stays, to be locked again.
    """
    while locks:
        port, fd = locks.pop()
        try:
            if _is_at(fd, _lock_path(port)):
                os.unlink(_lock_path(port))
        except OSError:
            pass
        os.close(fd)  # closing the last descriptor releases the flock


def sweep_stale_locks() -> None:
    """Remove the port lock files no process holds: a launcher killed (SIGKILL) never released its own.

    Each is locked first and removed while locked, as :func:`release` does, so a lock file a launcher
    holds stays, and one that opened a file just before it went locks the path's new file (:func:`_port_lock`).
    """
    for path in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), "dtrain-port-*.lock")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or another user's that this one may not open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _is_at(fd, path):
                os.unlink(path)
        except OSError:  # held by a running launcher, or another user's in a sticky temp folder
            pass
        finally:
            os.close(fd)


def _claim(base: int, count: int, host: str, locks: list) -> Optional[tuple[int, str]]:
    """Lock ports ``base .. base+count-1`` for this launcher (``(port, fd)`` appended to ``locks``) and check
    that each can be listened on; ``(port, why)`` of the first that cannot (its locks released)."""
    taken = []
    try:
        for port in range(base, base + count):
            try:
                fd = _port_lock(port)
                problem = (port, "another ./launch job on this machine holds it")  # where fd is None
            except OSError as err:  # not this launcher's to take, though no launcher may hold it
                if err.errno == errno.EMFILE:  # this launcher's own limit, whichever port it tried
                    raise
                fd, problem = None, (port, f"its lock file {err.filename} cannot be opened or locked: {err.strerror}")
            if fd is not None:
                taken.append((port, fd))
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as MLX's ring listens
                    try:
                        s.bind((host, port))
                        continue
                    except OSError:
                        problem = (port, f"a process on {host} listens on it")
            release(taken)
            return problem
    except BaseException as err:  # a lock taken is never left behind, whatever fails after it
        release(taken)
        if isinstance(err, OSError) and err.errno == errno.EMFILE:  # no lock file or socket left to open
            raise LaunchError(f"{count} ranks' ports: the launcher holds a lock file for each while the job runs, "
                              f"past its limit of {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} open files; "
                              f"raise it (ulimit -n) or start fewer ranks") from None
        raise
    locks.extend(taken)
    return None


def ephemeral_ports() -> tuple[int, int]:
    """The system's ephemeral port range ``(first, last)``: the ports it hands to outgoing
    connections and to ``bind(port 0)``, so any of them can be taken between a check and a listen.

    Read from Linux's ``/proc/sys/net/ipv4/ip_local_port_range`` or macOS's
    ``sysctl net.inet.ip.portrange``; IANA's 49152-65535 where neither answers.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first, last = map(int, f.read().split())
            return first, last
    except (OSError, ValueError):
        pass
    try:
        out = subprocess.run(["sysctl", "-n", "net.inet.ip.portrange.first", "net.inet.ip.portrange.last"],
                             capture_output=True, text=True, timeout=5).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 49152, 65535


def spare_base(count: int, rng: random.Random, ephemeral: tuple[int, int]) -> int:
    """A random first port of ``count`` consecutive ports that all lie outside
    ``ephemeral`` (:func:`ephemeral_ports`, read once by the caller: no outgoing connection is given one of them), from
    :data:`PORT_FLOOR` up; not checked for listeners (:func:`free_ports` does that).

    Raises:
        LaunchError: the ephemeral range leaves no such span.
    """
    first, last = ephemeral
    spans = [(a, b) for a, b in [(PORT_FLOOR, first - count), (last + 1, 65536 - count)] if b > a]
    if not spans:
        raise LaunchError(f"the system's ephemeral ports {first}-{last} leave no {count} spare ports; pass --port")
    return rng.randrange(*rng.choice(spans))


def check_span(first: int, count: int) -> None:
    """The ``count`` consecutive ports from the user's ``--port first`` end at 65535 or before.

    Raises:
        LaunchError: they run past it (MLX would be given port 65536 and up, and every rank fail to join).
    """
    if first + count - 1 > 65535:
        raise LaunchError(f"--port {first}: the job needs {count} consecutive ports from it, past the last "
                          f"TCP port 65535; pass --port {65536 - count} or lower")


def free_ports(count: int, first: Optional[int], locks: list, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports on ``host`` for this job's ranks.

    Each port is claimed with a lock file that the launcher holds while its job
    runs (``(port, fd)`` appended to ``locks``; :func:`release` frees them), so two
    launchers started together never take the same ports, and checked to be
    free of listeners; lock files no launcher holds are swept first
    (:func:`sweep_stale_locks`). ``first``: the user's ``--port``, taken as is; None:
    :data:`DEFAULT_PORT`, else a :func:`spare_base` (outside the ephemeral
    range, where a port checked free could be handed to a connection before
    the ranks listen on it).

    Raises:
        LaunchError: ``first`` (or one of the ports after it) is in use, they run past port 65535, or their lock
            files past the launcher's open-file limit.
    """
    sweep_stale_locks()
    if first is not None:
        check_span(first, count)
        problem = _claim(first, count, host, locks)
        if problem is not None:
            raise LaunchError(f"port {problem[0]} is in use ({problem[1]}); pass another --port, "
                              "or leave --port out to take free ones")
        return first
    base, rng, ephemeral = DEFAULT_PORT, random.SystemRandom(), ephemeral_ports()
    for _ in range(50):
        if _claim(base, count, host, locks) is None:
            return base
        base = spare_base(count, rng, ephemeral)
    raise LaunchError(f"found no {count} free consecutive ports on {host}; pass --port")


def build_plan(config: str, overrides: list[str], cfg, *, ranks: int = 1, backend: Optional[str] = None,
               port: Optional[int] = None, hostfile: Optional[Hostfile] = None, hostfile_path: Optional[str] = None,
               tmpdir: Optional[str] = None, port_locks: Optional[list] = None, restart: bool = False) -> Plan:
    """The plan for ``config`` + ``overrides`` on ``ranks`` local ranks or one rank per ``hostfile`` host.

    Args:
        config: the YAML path every rank reads.
        overrides: ``section.key=value`` strings passed on to every rank.
        cfg: the resolved :class:`dtrain.config.Config` (batch sizes, backend).
        ranks: ranks on this machine (1 without a hostfile: no distributed setup).
        backend: ``--backend``; None takes the hostfile's, then the config's, then ring.
        port: the first ring/JACCL port, or the NCCL port; None: free ones for
            ranks on this machine (:func:`free_ports`), else :data:`DEFAULT_PORT`
            (on a ``restart``, a :func:`spare_base`).
        hostfile: a validated hostfile (``hostfile_path`` names it), or None.
        tmpdir: where MPI's host list and the ring's MLX_HOSTFILE are written.
        port_locks: receives the locks on the ports of ranks on this machine
            (:func:`free_ports`); the caller releases them when the job ends (:func:`release`). None: none
            are held past the check (a plan only printed).
        restart: a restart of the job: a hostfile job without ``port`` moves to random ports, since the
            launcher cannot check the other hosts' ports, where a rank of the failed attempt may still hold its own.
    Raises:
        LaunchError: a combination that cannot run (``-n`` with a hostfile, a backend for one rank), a port in use.
    """
    explicit, notes = base_env()
    named = f"--backend {backend}" if backend else f"distributed.backend {cfg.distributed.backend}"
    backend = backend or (hostfile.backend if hostfile else None)
    if backend is None and cfg.distributed.backend != "any":
        backend = cfg.distributed.backend
    if hostfile is not None:
        if ranks != 1:
            raise LaunchError("use either -n (ranks on this machine) or --hostfile (one rank per host), not both")
        hosts = [h.ssh for h in hostfile.hosts]
        backend = backend or "ring"
        check_backend(hostfile, backend, hostfile_path or "hostfile")
    elif ranks > 1:
        hosts = ["127.0.0.1"] * ranks
        backend = backend or "ring"
        if backend == "jaccl":
            raise LaunchError("the jaccl backend needs a hostfile with 'rdma' devices (--hostfile HOSTS.json)")
    elif backend is not None:  # the rank would fail joining its group (exit 4, which a restart repeats)
        raise LaunchError(f"{named} needs 2 or more ranks, and this launch starts one (MLX forms no group of one "
                          f"process); pass -n N or --hostfile HOSTS.json, or leave the backend out to train on "
                          f"one rank")
    else:
        hosts = ["localhost"]
    n = len(hosts)
    t = cfg.train
    common = dict(backend=backend or "none", world_size=n, hosts=hosts, explicit=explicit, notes=notes,
                  shards=shard_sizes(t.global_batch_pairs, n), global_batch_pairs=t.global_batch_pairs,
                  micro_batch_pairs=t.micro_batch_pairs, noun=example_noun(cfg.objective.kind),
                  local=hostfile is None, tmpdir=tmpdir)
    program = rank_program(config, overrides, backend)
    if backend is None:
        return Plan(command=program, rank_env=[dict(explicit)], **common)
    if backend == "mpi":
        return _mpi_plan(hostfile, program, tmpdir, common)
    if hostfile is None:
        count = n if backend == "ring" else 1
        held = [] if port_locks is None else port_locks
        port = free_ports(count, port, held)
        if port_locks is None:  # the caller holds none: checked free, and no lock file left behind
            release(held)
        return replace(_direct_plan(backend, port, program, tmpdir, common), ports=tuple(range(port, port + count)))
    count = sum(len(h.ips) for h in hostfile.hosts) if backend == "ring" else 1  # one ring port per IP
    if port is None:
        port = spare_base(count, random.SystemRandom(), ephemeral_ports()) if restart else DEFAULT_PORT
    check_span(port, count)
    return _mlx_launch_plan(hostfile, hostfile_path, backend, port, program, common)


def _direct_plan(backend, port, program, tmpdir, common) -> Plan:
    """Ranks on this machine, each started by the launcher with mlx.launch's variables for it."""
    n, explicit = common["world_size"], dict(common["explicit"])
    explicit[LOCAL_RANKS_VAR] = str(n)  # they share this machine's memory: each plans within its share
    if backend == "nccl":
        explicit["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off: it hangs on some multi-GPU hosts
    common["explicit"] = explicit
    rank_env = [{**explicit, **rank_variables(backend, r, [["127.0.0.1"]] * n, port)} for r in range(n)]
    files, direct = {}, []
    for env in rank_env:
        started = dict(env)
        for key in FILE_VARS:
            if env.get(key):  # the same content for every rank: one file
                path = os.path.join(tmpdir or ".", f"{key.lower()}.json")
                files[path] = env[key]
                started[key] = path
        direct.append(started)
    return Plan(command=program, rank_env=rank_env, files=files, direct=direct, **common)


def _mlx_launch_plan(hostfile, hostfile_path, backend, port, program, common) -> Plan:
    explicit = dict(common["explicit"])
    if backend == "nccl":
        explicit["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off: it hangs on some multi-GPU hosts
        common["explicit"] = explicit
    where = ["--hostfile", hostfile_path]
    port_flag = ["--nccl-port", str(port)] if backend == "nccl" else ["--starting-port", str(port)]
    envs = hostfile_env(hostfile)
    # mlx.launch adds the hostfile's own; ranks on this machine inherit the rest from mlx.launch
    passed = {k: v for k, v in _for_ranks(explicit, False).items() if k not in envs}
    command = [mlx_launch_path(), *where, "--backend", backend, *port_flag, *_env_flags("--env", passed), "--", *program]
    ips, rdma = [h.ips for h in hostfile.hosts], [h.rdma for h in hostfile.hosts]
    rank_env = [{**_for_ranks(explicit, h.ssh == "127.0.0.1"), **envs,  # mlx.launch starts 127.0.0.1's itself
                 **rank_variables(backend, r, ips, port, rdma, one_gpu_per_host=True)}
                for r, h in enumerate(hostfile.hosts)]
    own = {}
    if common["tmpdir"]:
        # mlx.launch 0.32's start script makes two files per rank with mktemp and never removes them (a pid file,
        # MLX_HOSTFILE's content): in the launcher's temporary folder they go with it. Its ranks on this machine
        # get their TMPDIR back (dtrain.launch.rank), where MLX caches its CPU kernels; ssh passes neither on.
        own = {"TMPDIR": common["tmpdir"], RANK_TMPDIR_VAR: envs.get("TMPDIR", os.environ.get("TMPDIR", ""))}
    return Plan(command=command, rank_env=rank_env, command_env=own, **common)


def mpi_library_env(mpirun: str, env: Optional[dict] = None) -> dict:
    """The variables with which MLX's MPI backend loads the ``libmpi`` of ``mpirun``, as mlx.launch 0.32
    sets them (``launch_mpi``, ``get_mpi_libname``); empty when ``ompi_info`` or its libmpi is not found.

    MLX dlopens ``MLX_MPI_LIBNAME``, else the bare ``libmpi.dylib`` (macOS) or ``libmpi.so``
    (``mlx/distributed/mpi/mpi.cpp``): Homebrew's ``/opt/homebrew/lib`` is not on dyld's search
    path, and Debian's ``openmpi-bin`` has only ``libmpi.so.40``. The name is the libmpi that
    ``ompi_info`` links (``otool -L`` on macOS, ``ldd`` elsewhere), made absolute where it lies in
    mpirun's ``../lib``; macOS also gets that folder in ``DYLD_LIBRARY_PATH`` (prepended). A
    ``MLX_MPI_LIBNAME`` already in ``env`` (default os.environ) is kept.
    """
    env = os.environ if env is None else env
    lib_dir = os.path.join(os.path.dirname(os.path.dirname(mpirun)), "lib")
    darwin = platform.system() == "Darwin"
    out = {}
    if darwin and os.path.isdir(lib_dir):
        out["DYLD_LIBRARY_PATH"] = ":".join(p for p in (lib_dir, env.get("DYLD_LIBRARY_PATH", "")) if p)
    if env.get("MLX_MPI_LIBNAME"):
        return out
    beside = os.path.join(os.path.dirname(mpirun), "ompi_info")
    ompi_info = beside if os.path.exists(beside) else shutil.which("ompi_info")
    if ompi_info is None:
        return out
    try:
        listing = subprocess.run(["otool", "-L", ompi_info] if darwin else ["ldd", ompi_info],
                                 capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return out
    # otool: "<install name> (compatibility version ...)"; ldd: "<soname> => <path> (0x...)"; a folder may hold spaces
    names = [x.strip().rsplit(" (", 1)[0].split(" => ")[0] for x in listing.splitlines()[1 if darwin else 0:]
             if "libmpi" in x and x.strip()]
    if not names:
        return out
    name = names[0].removeprefix("@rpath/")
    if "/" not in name and os.path.exists(os.path.join(lib_dir, name)):
        name = os.path.join(lib_dir, name)
    out["MLX_MPI_LIBNAME"] = name
    return out


def _mpi_plan(hostfile, program, tmpdir, common) -> Plan:
    n = common["world_size"]
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise LaunchError("--backend mpi needs mpirun on PATH (Debian: apt-get install openmpi-bin; macOS: brew install open-mpi)")
    explicit = common["explicit"] = {**mpi_library_env(mpirun), **common["explicit"]}
    flags = ["-np", str(n)]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")  # OpenMPI refuses root without it
    files = {}
    if hostfile is not None:
        path = os.path.join(tmpdir or ".", "mpi_hosts")
        files[path] = "".join(f"{h} slots=1\n" for h in common["hosts"])
        flags += ["--hostfile", path]
    elif n > (os.cpu_count() or 1):
        flags.append("--oversubscribe")  # more ranks than cores on this machine
    # mpirun's own environment keeps the hostfile's out; its ranks on this machine inherit the rest from it
    envs = hostfile_env(hostfile)
    command = [mpirun, *flags, *_env_flags("-x", {**_for_ranks(explicit, hostfile is None), **envs}), "--", *program]
    ips = [[h] for h in common["hosts"]]
    rank_env = [{**_for_ranks(explicit, h == "127.0.0.1"), **envs, **rank_variables("mpi", r, ips, 0)}
                for r, h in enumerate(common["hosts"])]
    return Plan(command=command, rank_env=rank_env, files=files, **common)


def describe(plan: Plan, attempt_env: Optional[dict] = None) -> str:
    """The human-readable plan printed by ``--dry-run``. ``attempt_env``: the variables each attempt passes
    to the ranks (:func:`command_with_env`; values a real attempt makes, such as its job id, as placeholders)."""
    hosts = sorted(set(plan.hosts))
    lines = [
        f"ranks: {plan.world_size}",
        f"backend: {plan.backend}",
        f"hosts: {', '.join(hosts)}",
        f"command{' (each rank)' if plan.direct else ''}: {' '.join(command_with_env(plan, attempt_env or {}))}",
    ]
    for path, content in plan.files.items():
        lines.append(f"file {path}: {content.strip()!r}")
    for r in range(plan.world_size):
        lines.append(f"rank {r} on {plan.hosts[r]}: shard {plan.shards[r]} {plan.noun}s/step")
        for k, v in sorted(plan.rank_env[r].items()):
            shown = f"<temp file> {v}" if k in FILE_VARS and v else v
            lines.append(f"  {k}={shown}")
    split = " + ".join(map(str, plan.shards))
    micro = min(max(plan.shards), plan.micro_batch_pairs)  # what a rank runs, as the first step's line says
    lines.append(f"global batch: {plan.global_batch_pairs} {plan.noun}s/step = {split} (micro-batches of {micro})")
    return "\n".join(lines)
