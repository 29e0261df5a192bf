"""Models: load ``demo``, GGUF files, mlx-lm/HF folders and hub ids; convert GGUF to mlx-lm."""

from .convert import convert_gguf
from .demo import demo_model_path
from .load import LoadedModel, load_model

__all__ = ["LoadedModel", "convert_gguf", "demo_model_path", "load_model"]
