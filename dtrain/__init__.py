"""dtrain: ORPO + LoRA preference training on MLX.

data -> tokenized pairs -> per-rank shard -> engine -> all-reduce -> AdamW step.
"""

__version__ = "0.1.0"
