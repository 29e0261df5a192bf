"""dtrain: ORPO + LoRA preference training on MLX.

data -> tokenized pairs -> per-rank shard -> engine -> all-reduce -> AdamW step.
"""

__version__ = "0.1.0"

from .blas import preload_openblas as _preload_openblas

# Before anything imports MLX: route its CPU BLAS calls to OpenBLAS (Linux).
_preload_openblas()
