"""TensorBoard scalars (tensorboardX) and the progress bar (tqdm), rank 0 only.

Each run gets a new directory under ``OUTPUT_DIR/tb``, created with an
exclusive ``mkdir`` so two runs never share one, even in the same second. A
resumed run passes the directory of the run it continues.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import yaml


def new_run_dir(root: Path) -> Path:
    """Create and return ``root/YYYYmmdd-HHMMSS-N``, the first N that is free."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while True:
        path = root / f"{stamp}-{n}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


class RunLogger:
    """Writes scalars, the resolved config and hparams; a no-op off rank 0.

    Args:
        run_dir: TensorBoard directory of this run (None disables writing).
        total_steps: for the progress bar.
        progress: show a tqdm bar on stderr.
        first_step: steps already done (a resumed run).
        purge_step: on resume, the first step this run will log.
    """

    def __init__(self, run_dir: Optional[Path], total_steps: int, progress: bool = True, first_step: int = 0,
                 purge_step: Optional[int] = None):
        self.run_dir = run_dir
        self.writer = None
        self.bar = None
        if run_dir is not None:
            from tensorboardX import SummaryWriter

            # purge_step: TensorBoard drops events at or after this step from
            # earlier files of the folder (a resumed run overwrites, never duplicates)
            self.writer = SummaryWriter(logdir=str(run_dir), flush_secs=10, purge_step=purge_step)
            if progress:
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, initial=first_step, file=sys.stderr, dynamic_ncols=True, unit="step")

    def config(self, resolved: dict) -> None:
        if self.writer is not None:
            text = yaml.safe_dump(resolved, sort_keys=False)
            self.writer.add_text("config", "```\n" + text + "\n```", 0)

    def scalars(self, step: int, values: dict) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def progress(self, step: int, values: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{values.get('loss', float('nan')):.4f}", pairs_s=f"{values.get('pairs_per_second', 0):.2f}")

    def message(self, text: str) -> None:
        if self.writer is None:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def hparams(self, resolved: dict, final: dict) -> None:
        """Record the flattened config with the final metrics (TensorBoard HPARAMS)."""
        if self.writer is None:
            return
        flat = {}
        for section, values in resolved.items():
            for key, value in values.items():
                flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
        metrics = {f"hparam/{k}": v for k, v in final.items() if isinstance(v, float)}
        self.writer.add_hparams(flat, metrics, name="hparams", global_step=None)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None


def peak_memory_gb() -> float:
    import mlx.core as mx

    return mx.get_peak_memory() / 1e9


def read_scalars(run_dir: Path) -> dict:
    """Scalars from the event files in ``run_dir``: tag -> [(step, value)].

    Reads the TFRecord framing (u64 length, u32 crc, payload, u32 crc) and
    parses each payload with tensorboardX's ``Event`` protobuf. Like
    TensorBoard, a ``SessionLog.START`` event at step ``s`` (written with
    ``purge_step``) discards values logged earlier at steps ``>= s``.
    """
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out: dict = {}
    for path in sorted(Path(run_dir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            payload = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            event = Event.FromString(payload)
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                out = {tag: [(s, v) for s, v in vals if s < event.step] for tag, vals in out.items()}
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out
