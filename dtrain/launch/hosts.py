"""Read and validate a hostfile in ``mlx.launch``'s JSON format, before anything starts.

Two shapes are accepted, as ``mlx._distributed_utils.common.Hostfile.from_file``
reads them::

    [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]

    {"backend": "jaccl", "envs": ["KEY=VALUE"],
     "hosts": [{"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [null, "rdma_en2"]},
               {"ssh": "mac2", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", null]}]}

An ``rdma`` entry is a device name, a list of device names (several
Thunderbolt links between two Macs, as ``mlx.distributed_config`` writes
them) or null (itself). mlx.launch 0.32 (``launch_jaccl``) gives every JACCL
rank ``MLX_RANK``, ``MLX_JACCL_COORDINATOR`` (host 0's first IP and
``--starting-port``) and ``MLX_IBV_DEVICES`` (a file holding the ``rdma`` lists).

mlx.launch accepts unknown keys silently and fails late (or hangs) on a bad
file; here every problem is one :class:`LaunchError` line naming the file,
the line the host starts on and the host.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..contract import BACKENDS
from ..data.jsonfile import first_repeat
from ..errors import TOO_DEEP, UserError
from ..files import unusable_path

TOP_KEYS = ("backend", "envs", "hosts")
HOST_KEYS = ("ssh", "ips", "rdma")
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)


class LaunchError(UserError):
    """A launcher input (hostfile, options) that cannot work."""


@dataclass
class Host:
    """One machine: ``ssh`` name, ``ips`` for ring/NCCL/JACCL traffic, ``rdma`` devices (JACCL)."""

    ssh: str
    ips: list = field(default_factory=list)
    rdma: list = field(default_factory=list)


@dataclass
class Hostfile:
    """``hosts`` in rank order; ``lines``: the 1-based line each host starts on (empty when not from a file)."""

    hosts: list
    backend: Optional[str] = None
    envs: list = field(default_factory=list)
    lines: list = field(default_factory=list)

    def where(self, path: str, i: int) -> str:
        """``path:line`` of host ``i`` (``path`` alone without line numbers)."""
        return f"{path}:{self.lines[i]}" if i < len(self.lines) else path


def _is_ip(text) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _device(d) -> bool:
    return isinstance(d, str) and bool(d.strip())


def _host(i: int, raw, where: str) -> Host:
    if not isinstance(raw, dict):
        raise LaunchError(f"{where}: host {i} must be an object like {{\"ssh\": \"mac1\", \"ips\": [\"10.0.0.1\"]}}, got {raw!r}")
    ssh = raw.get("ssh")
    unknown = sorted(set(raw) - set(HOST_KEYS))
    if unknown:
        name = f" ({ssh})" if isinstance(ssh, str) and ssh.strip() else ""
        raise LaunchError(f"{where}: host {i}{name}: unknown key(s) {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(HOST_KEYS)})")
    if not isinstance(ssh, str) or not ssh.strip():
        raise LaunchError(f"{where}: host {i}: 'ssh' must be a non-empty host name, got {ssh!r}")
    if ssh.startswith("-") or any(c.isspace() for c in ssh):  # ssh would read it as options, or as a command
        raise LaunchError(f"{where}: host {i}: 'ssh' must be one host name (as `ssh NAME` takes it, or a Host of "
                          f"~/.ssh/config), not options or words, got {ssh!r}")
    ips = raw.get("ips", [])
    if not isinstance(ips, list):
        raise LaunchError(f"{where}: host {i} ({ssh}): 'ips' must be a list of IP addresses, got {ips!r}")
    for ip in ips:
        if not isinstance(ip, str):  # ipaddress reads a number as an address: 5 would be 0.0.0.5
            raise LaunchError(f"{where}: host {i} ({ssh}): {json.dumps(ip)} in 'ips' is not a string; write each IP "
                              f"address in quotes, e.g. \"192.168.1.2\"")
        if not _is_ip(ip):
            raise LaunchError(f"{where}: host {i} ({ssh}): {ip!r} in 'ips' is not an IP address (use e.g. 192.168.1.2, not a host name)")
    rdma = raw.get("rdma", [])
    if not isinstance(rdma, list):
        raise LaunchError(f"{where}: host {i} ({ssh}): 'rdma' must be a list with one device (or null) per host, got {rdma!r}")
    for j, d in enumerate(rdma):
        if not (d is None or _device(d) or (isinstance(d, list) and d and all(map(_device, d)))):
            raise LaunchError(f"{where}: host {i} ({ssh}): rdma[{j}] must be a device name such as \"rdma_en2\", "
                              f"a list of them, or null; got {d!r}")
    return Host(ssh, list(ips), list(rdma))


def parse_hostfile(data, where: str = "hostfile", lines: Optional[list] = None) -> Hostfile:
    """Validate decoded hostfile JSON (structure, keys, addresses, duplicates).

    ``lines``: the line each host starts on (:func:`host_lines`), for the messages.

    Raises:
        LaunchError: one line naming the file, the host and the problem.
    """
    backend, envs = None, []
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(TOP_KEYS))
        if unknown:
            raise LaunchError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(TOP_KEYS)})")
        if "hosts" not in data:
            raise LaunchError(f"{where}: missing 'hosts' (a list of {{\"ssh\": ..., \"ips\": [...]}})")
        backend, envs, data = data.get("backend") or None, data.get("envs", []), data["hosts"]
        if backend == "jaccl-ring":  # mlx.launch's, which the rank contract does not cover yet
            raise LaunchError(f"{where}: backend 'jaccl-ring' (JACCL over a ring of Macs not all cabled to each "
                              f"other) is not supported by dtrain yet; use jaccl with every pair of Macs cabled, or "
                              f"ring over the Thunderbolt IPs")
        if backend is not None and backend not in BACKENDS:
            raise LaunchError(f"{where}: backend {backend!r} must be one of {', '.join(BACKENDS)}")
        if not isinstance(envs, list) or not all(isinstance(e, str) and _ENV.fullmatch(e) for e in envs):
            raise LaunchError(f"{where}: 'envs' must be a list of \"NAME=VALUE\" strings, got {envs!r}")
    if not isinstance(data, list) or not data:
        raise LaunchError(f"{where}: expected a non-empty list of hosts, got {data!r}")
    hf = Hostfile([], backend, list(envs), list(lines or []))
    hf.hosts = [_host(i, raw, hf.where(where, i)) for i, raw in enumerate(data)]
    seen: dict = {}
    for i, h in enumerate(hf.hosts):
        for key in [("ssh", h.ssh)] + [("ip", ip) for ip in h.ips]:
            # one host may list an IP twice (mlx.distributed_config does for hosts given by IP): two connections
            if seen.get(key, i) != i:
                raise LaunchError(f"{hf.where(where, i)}: host {i} ({h.ssh}): repeats {key[0]} {key[1]!r} of host {seen[key]}; "
                                  f"list each machine once")
            seen[key] = i
    return hf


def host_lines(text: str) -> list[int]:
    """The 1-based line on which each host of hostfile JSON ``text`` starts (``text`` must parse).

    Walks the top level with ``json.JSONDecoder.raw_decode``, which reports where each value ends.
    """
    decode, n = json.JSONDecoder().raw_decode, len(text)

    def skip(i: int) -> int:
        while i < n and text[i] in " \t\r\n,:":
            i += 1
        return i

    def elements(i: int) -> list[int]:
        out, i = [], skip(i + 1)
        while i < n and text[i] != "]":
            out.append(text.count("\n", 0, i) + 1)
            i = skip(decode(text, i)[1])
        return out

    i = skip(0)
    if i < n and text[i] == "[":
        return elements(i)
    if i >= n or text[i] != "{":
        return []
    found, i = [], skip(i + 1)
    while i < n and text[i] != "}":
        key, i = decode(text, i)
        i = skip(i)
        if key == "hosts" and text[i] == "[":
            found = elements(i)  # the last "hosts" wins, as in json.loads
        i = skip(decode(text, i)[1])
    return found


def _unique_keys(pairs: list, path: str) -> dict:
    """A JSON object of ``pairs``, refusing a key given twice (``json.loads`` keeps the last silently)."""
    key = first_repeat(k for k, _ in pairs)
    if key is not None:
        raise LaunchError(f"{path}: key '{key}' given twice in one object (JSON would keep the last silently); keep one")
    return dict(pairs)


def load_hostfile(path: str) -> Hostfile:
    """Read and validate ``path`` (see :func:`parse_hostfile`).

    Raises:
        LaunchError: missing or unreadable file, invalid JSON, or any structural problem.
    """
    p = Path(path)
    try:
        is_dir, is_file = p.is_dir(), p.is_file()
    except OSError as err:  # a name too long for the file system
        raise LaunchError(unusable_path(path, err, "hostfile path")) from None
    if is_dir:
        raise LaunchError(f"{path}: is a directory, not a hostfile")
    if not is_file and p.exists():  # a pipe, a socket or a device
        raise LaunchError(f"{path}: not a regular file (a pipe, a socket or a device); give the hostfile as a file")
    if not is_file:
        raise LaunchError(f"{path}: hostfile not found")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, path))
    except json.JSONDecodeError as err:
        raise LaunchError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise LaunchError(f"{path}: not UTF-8 text ({err})") from None
    except OSError as err:  # no read permission, a disk error
        raise LaunchError(f"{path}: cannot read the hostfile: {err.strerror or err}") from None
    except RecursionError:
        raise LaunchError(f"{path}: not valid JSON ({TOO_DEEP})") from None
    except ValueError:  # int() of more than 4300 digits, json's one ValueError that is no JSONDecodeError
        raise LaunchError(f"{path}: not valid JSON (an integer of more than 4300 digits)") from None
    return parse_hostfile(data, path, host_lines(text))


def check_backend(hf: Hostfile, backend: str, where: str = "hostfile") -> None:
    """The per-backend rules: every backend needs 2 or more hosts (one rank each), ring IPs on every
    host, NCCL/JACCL an IP on host 0 (the coordinator), IPv4 addresses where MLX connects, JACCL one ``rdma``
    entry per host with null for itself.

    Raises:
        LaunchError: naming the first host that breaks a rule.
    """
    hosts = hf.hosts
    if len(hosts) == 1:  # the rank would fail joining its group (exit 4, which a restart repeats)
        raise LaunchError(f"{where}: lists one host, and --hostfile starts one rank per host; the {backend} backend "
                          f"needs 2 or more ranks (MLX forms no group of one process); list 2 or more hosts, or "
                          f"leave --hostfile out to train on one rank")
    if backend == "ring":
        for i, h in enumerate(hosts):
            if not h.ips:
                raise LaunchError(f"{hf.where(where, i)}: host {i} ({h.ssh}): no 'ips'; the ring backend connects to IP addresses")
    if backend in ("jaccl", "nccl") and not hosts[0].ips:
        raise LaunchError(f"{hf.where(where, 0)}: host 0 ({hosts[0].ssh}): no 'ips'; the {backend} coordinator must be reachable by IP")
    # MLX 0.32 splits "ip:port" at its first colon and opens AF_INET sockets (distributed/utils.cpp): an IPv6
    # address failed every rank at start-up as a lost peer (exit 4), which --max-restarts repeated
    used = [(i, ip) for i, h in enumerate(hosts) for ip in h.ips] if backend == "ring" else \
        [(0, hosts[0].ips[0])] if backend in ("jaccl", "nccl") else []  # the coordinator's
    for i, ip in used:
        if ipaddress.ip_address(ip).version == 6:
            what = "ring backend" if backend == "ring" else f"{backend} coordinator"
            raise LaunchError(f"{hf.where(where, i)}: host {i} ({hosts[i].ssh}): {ip!r} in 'ips' is an IPv6 address; "
                              f"MLX's {what} connects over IPv4 only: use the host's IPv4 address (e.g. "
                              f"192.168.10.2; on a Thunderbolt Bridge without one, its self-assigned 169.254.x.x)")
    if backend == "jaccl":
        for i, h in enumerate(hosts):
            at = hf.where(where, i)
            if len(h.rdma) != len(hosts):
                raise LaunchError(f"{at}: host {i} ({h.ssh}): 'rdma' lists {len(h.rdma)} devices; jaccl needs one per host ({len(hosts)}), null for itself")
            if h.rdma[i] is not None:
                raise LaunchError(f"{at}: host {i} ({h.ssh}): rdma[{i}] must be null (a host has no RDMA link to itself)")
            missing = [j for j, d in enumerate(h.rdma) if j != i and d is None]
            if missing:
                raise LaunchError(f"{at}: host {i} ({h.ssh}): no RDMA device to host(s) {', '.join(map(str, missing))}")
