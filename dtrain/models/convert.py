"""``dtrain convert GGUF_FILE OUT_DIR``: a GGUF file → an mlx-lm model folder."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mlx_lm.utils import save_config, save_model

from ..errors import ModelError
from .gguf import gguf_to_mlx
from .load import build_gguf_model
from .tokenizer import build_tokenizer, eos_token_ids


def convert_gguf(gguf_path: str, out_dir: str, dequantize: bool = False) -> Path:
    """Write an mlx-lm model folder for a llama or gemma3 GGUF file.

    The folder holds ``config.json`` (with mlx-lm's per-module ``quantization``
    entry when quantized weights are kept), ``model.safetensors`` (HF tensor
    names; llama Q/K rows un-permuted, gemma3 norms without llama.cpp's +1) and
    the tokenizer files from ``PreTrainedTokenizerFast.save_pretrained``
    (including the chat template), so ``mlx_lm.load(out_dir)`` and
    ``python -m mlx_lm generate --model OUT_DIR --adapter-path ADAPTER`` work.
    It is written into a temporary sibling folder and renamed into place.

    Args:
        gguf_path: the GGUF file.
        out_dir: a folder that does not exist yet, or is empty.
        dequantize: store Q4_0/Q4_1/Q8_0 weights as float32 instead of keeping
            them as MLX affine-quantized layers (group size 32).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ModelError: a missing or unreadable GGUF file, an unsupported
            architecture, or an ``out_dir`` that is a file or not empty.
    """
    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise ModelError(f"{gguf_path}: no such GGUF file")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelError(f"{out_dir}: output folder already exists and is not empty; choose a new folder")
    gm = gguf_to_mlx(src)
    try:
        tokenizer = build_tokenizer(gm.metadata)
    except (ValueError, KeyError) as err:
        raise ModelError(f"{gguf_path}: cannot build the tokenizer from GGUF metadata: {err}") from None
    model, config = build_gguf_model(gm, keep_quantized=not dequantize, float_dtype=None)
    config["eos_token_id"] = eos_token_ids(gm.metadata)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        tokenizer.save_pretrained(str(tmp))
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
