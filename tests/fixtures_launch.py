"""A tiny real job for tests that run ``./launch`` as a subprocess.

``make_job(tmp)`` writes a random 2-layer llama (mlx-lm folder: weights,
``config.json``, tokenizer files) and a YAML config that trains it on 16 demo
pairs for 2 steps; a run takes a few seconds on the CPU.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from conftest import make_tiny_model, make_tokenizer
from dtrain.launch.plan import _claim, ephemeral_ports, release, spare_base
from waiting import JOB_S, finish

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"

MODEL_CONFIG = dict(
    model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=True,
)


def make_model_folder(path: Path) -> Path:
    """Save a tiny random llama and the test tokenizer as an mlx-lm model folder."""
    from mlx_lm.utils import save_config, save_model

    path.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(num_hidden_layers=MODEL_CONFIG["num_hidden_layers"])
    save_model(path, model)
    save_config(dict(MODEL_CONFIG), config_path=path / "config.json")
    make_tokenizer()._tokenizer.save_pretrained(str(path))
    return path


def make_job(tmp: Path, steps: int = 2, global_batch_pairs: int = 4) -> Path:
    """Write the tiny model and a config training it; returns the config path."""
    model = make_model_folder(tmp / "model")
    config = tmp / "job.yaml"
    config.write_text(
        f"model: {{path: {model}, dtype: float32}}\n"
        "lora: {rank: 2}\n"
        "data: {demo_pairs: 16, max_length: 64, max_prompt_length: 32}\n"
        f"train: {{steps: {steps}, global_batch_pairs: {global_batch_pairs}, micro_batch_pairs: 4,"
        f" learning_rate: 1.0e-2, output_dir: {tmp / 'run'}, progress: false}}\n"
    )
    return config


# a stand-in for a rank's trainer that a SIGINT ends (killed by it) once it unblocks the stop signals, as
# dtrain's main() does: a rank wrapper starts its child with them blocked (dtrain.contract.STOP_SIGNALS)
TRAINER_STAND_IN = [sys.executable, "-c", "import signal, time\n"
                    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                    "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])\n"
                    "time.sleep(20)\n"]


def free_port(count: int = 4) -> int:
    """The first of ``count`` consecutive loopback ports free right now (the base of a ring's
    ports, or one port), drawn outside the system's ephemeral range as the launcher draws its
    own: a port that ``bind(port 0)`` hands out can be given to any outgoing connection, such
    as a finished run's ranks', before the next launcher listens on it."""
    rng, ephemeral = random.Random(), ephemeral_ports()
    for _ in range(100):
        base, locks = spare_base(count, rng, ephemeral), []
        problem = _claim(base, count, "127.0.0.1", locks)
        release(locks)  # checked free; the launcher under test claims them itself
        if problem is None:
            return base
    raise RuntimeError(f"no {count} free consecutive loopback ports found in 100 tries")


def launch(*args, limit: float = JOB_S, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``./launch ARGS`` with this interpreter to its end (``waiting.finish``); text output captured."""
    cmd = [sys.executable, str(LAUNCH), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    code, out, err = finish(proc, limit)
    return subprocess.CompletedProcess(cmd, code, out, err)


def write_hostfile(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path

