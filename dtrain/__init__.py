"""dtrain: LoRA preference training (ORPO, DPO, SimPO; SFT too) on MLX.

data -> tokenized pairs -> per-rank shard -> engine -> all-reduce -> AdamW step.

Importing dtrain loads nothing else. A program that trains on a Linux CPU calls
``dtrain.blas.setup()`` before its first ``import mlx``, as the ``dtrain``
command and ``./launch`` do: it loads the fastest correct BLAS it finds
(MLX's CPU wheel ships a slow reference BLAS; docs/benchmarks.md has the figures).
"""

__version__ = "0.1.0"
