"""The device-dependent ``auto`` values of a config, decided in one place.

``setup`` resolves them once (:func:`resolve_auto`), shows them once on rank 0
and writes them into the run's config text in TensorBoard; the engine and the
optimizer get the resolved values. :func:`on_gpu` is the one way to ask.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

from .memory import GIB, backend, default_budget_bytes  # the one owner of memory budgets


def on_gpu() -> bool:
    """True when MLX's default device is a GPU (Metal or CUDA build)."""
    return mx.default_device().type == mx.DeviceType.gpu


def default_length_bucket() -> int:
    """``engine.length_bucket: auto``: 128 on a GPU (a few compiled shapes), 0 (exact shapes) on the CPU."""
    return 128 if on_gpu() else 0


def default_kernels() -> str:
    """``engine.kernels: auto``: ``dtrain`` on the CPU (MLX's CPU exp and attention are the slow
    part of a step there), ``mlx`` on a GPU (fused kernels)."""
    return "mlx" if on_gpu() else "dtrain"


def default_attention_groups() -> int:
    """``engine.attention_groups: auto``: 1 on CUDA (each new call shape costs cuDNN a setup, more
    than the work saved at the recommended batch: docs/benchmarks.md), else 4. On the CPU and on
    Metal, whose fused attention has no backward (MLX trains through the unfused graph there),
    attention work and memory grow with rows x length², which the grouped calls cut."""
    from .engine.attention import ATTENTION_GROUPS

    return 1 if backend() == "cuda" else ATTENTION_GROUPS


def resolve_auto(cfg):
    """``(cfg', choices)``: ``cfg`` with its device-dependent ``auto`` values resolved (``model.dtype`` to the
    dtype whose plan is ``auto``'s here, ``models.load.dtype_plan``), and ``{"section.key": value}`` of every
    ``auto`` that was. A run's settings and checkpoints record these values, so a resume compares what ran."""
    from .models.load import dtype_plan

    model, e, t, choices = cfg.model, cfg.engine, cfg.train, {}
    if model.dtype == "auto":
        quantized, dtype = dtype_plan("auto")
        model = replace(model, dtype=str(dtype).removeprefix("mlx.core."))
        choices["model.dtype"] = model.dtype + (" (quantized base)" if quantized else "")
    if e.length_bucket == "auto":
        e = replace(e, length_bucket=default_length_bucket())
        choices["engine.length_bucket"] = e.length_bucket
    if e.attention_groups == "auto" and e.kind != "reference":
        e = replace(e, attention_groups=default_attention_groups())
        choices["engine.attention_groups"] = e.attention_groups
    if e.kernels == "auto" and e.kind != "reference":
        e = replace(e, kernels=default_kernels())
        choices["engine.kernels"] = e.kernels
    if e.kind == "auto" or e.segment_layers == "auto":
        if e.memory_budget_gb == 0:
            e = replace(e, memory_budget_gb=default_budget_bytes() / GIB)  # exact: GIB is a power of two
            choices["engine.memory_budget_gb"] = round(e.memory_budget_gb, 1)
    if t.compile_optimizer == "auto":
        t = replace(t, compile_optimizer=on_gpu())
        choices["train.compile_optimizer"] = t.compile_optimizer
    lora = cfg.lora
    if lora.branch_dtype == "auto":  # what the run's LoRA product computes in, which a resume compares
        lora = replace(lora, branch_dtype="bfloat16" if dtype_plan(cfg.model.dtype)[1] == mx.bfloat16 else "float32")
        choices["lora.branch_dtype"] = lora.branch_dtype
    return replace(cfg, model=model, engine=e, train=t, lora=lora), choices
