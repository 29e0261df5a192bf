"""What every bench/ script shares, imported first: the repository on ``sys.path``,
the folders it reads and writes, the repeated flags and the results writer.

Imports neither MLX nor a BLAS, so the scripts that only start other processes
(sweeps, the launcher's and the suite's timings) use it too; bench/common.py
builds on it for the scripts that run MLX in this process. A script in bench/
finds it as a plain ``import prelude`` (Python puts the script's folder first on
``sys.path``).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the one place bench/ puts the checkout's dtrain first

from dtrain.files import cache_dir  # noqa: E402  (standard library only)

RESULTS = ROOT / "bench" / "results"
DATA_DIR = Path(os.environ.get("DTRAIN_DATA_DIR", "data"))  # real preference data is not in the repository
ORCA = str(DATA_DIR / "orca_dpo_pairs_validation.jsonl")  # README: data
SMOLLM2_F32 = cache_dir() / "smollm2-135m-instruct-f32"  # the demo model as a float32 mlx-lm folder (peer.py)

FLAGS = {  # flags several scripts take: type, choices and the usual help; each script gives the default
    "steps": dict(type=int, help="timed steps"),
    "warmup": dict(type=int, help="untimed steps before the timed ones"),
    "dtype": dict(choices=("float32", "bfloat16", "float16"), help="dtype of the model's weights"),
    "layers": dict(type=int, help="decoder layers (default: the model's)"),
    "data": dict(help="preference pairs (read in place)"),
    "out": dict(help="folder the JSON results go to"),
}


def add_flags(parser, help: dict | None = None, **defaults):
    """Add ``--NAME`` (a key of :data:`FLAGS`) with its default for each keyword;
    ``help`` replaces FLAGS' help text where a script means something narrower."""
    for name, default in defaults.items():
        spec = {**FLAGS[name], "default": default}
        if help and name in help:
            spec["help"] = help[name]
        parser.add_argument(f"--{name}", **spec)
    return parser


def need_file(parser, path, flag: str) -> None:
    """Stop with ``parser``'s one-line error when the data file ``path`` (from ``flag``) is not there."""
    if not Path(path).is_file():
        parser.error(f"{path}: no such file; real pairs are not in the repository: set $DTRAIN_DATA_DIR "
                     f"to their folder (default ./data) or pass {flag}")


def machine() -> dict:
    """CPU model, cores and Python: the machine line of a process without MLX
    (bench/common.py's adds MLX, its device and the BLAS)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def runs_of(record: dict) -> dict:
    """The per-run entries of a sweep's ``results.json`` (keys ``DATASET/SETTING...``),
    without what :func:`write_results` adds (argv, machine) or notes (``_not_run``)."""
    return {key: run for key, run in record.items() if "/" in key}


def write_results(prefix: str, payload: dict, out: str | Path = RESULTS, machine_line: dict | None = None,
                  stamp: bool = True) -> Path:
    """Write ``payload`` plus ``argv`` and the machine line (default :func:`machine`) as JSON
    to ``out/prefix-STAMP.json``, or ``out/prefix.json`` without ``stamp``; returns the path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json" if stamp else f"{prefix}.json")
    line = machine() if machine_line is None else machine_line
    path.write_text(json.dumps({"argv": sys.argv[1:], "machine": line, **payload}, indent=1))
    return path
