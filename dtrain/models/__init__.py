"""Models: load ``demo``, GGUF files, mlx-lm/HF folders and hub ids; convert GGUF to mlx-lm.

``DTYPE_NAMES`` needs no import: dtrain.config reads it (``model.dtype``'s
allowed values) in processes that have not yet chosen their BLAS, and the
loaders import MLX, so they are imported on first use (PEP 562 ``__getattr__``).
"""

import importlib

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # compute dtypes besides "auto"; load.DTYPES maps them to MLX's

_LAZY = {"LoadedModel": "load", "load_model": "load", "convert_gguf": "convert", "demo_model_path": "demo",
         "DEMO_SHAPE": "demo"}
__all__ = ["DEMO_SHAPE", "DTYPE_NAMES", "LoadedModel", "convert_gguf", "demo_model_path", "load_model"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
