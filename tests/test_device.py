"""The device-dependent ``auto`` values, decided once (dtrain/device.py), and the output folder's parts."""

from pathlib import Path

import mlx.core as mx
import pytest

from dtrain.config import Config, load_config
from dtrain.device import GIB, resolve_auto
from dtrain.files import OutputDir
from dtrain.memory import physical_memory


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's choices")
def test_cpu_auto_choices_are_resolved_once_and_named():
    cfg, choices = resolve_auto(Config())
    ram = 0.5 * physical_memory()  # the machine's RAM, or a container's limit
    assert choices == {"model.dtype": "float32", "engine.length_bucket": 0,
                       "engine.memory_budget_gb": round(ram / GIB, 1), "train.compile_optimizer": False,
                       "engine.kernels": "dtrain", "engine.attention_groups": 4, "lora.branch_dtype": "float32"}
    assert (cfg.engine.length_bucket, cfg.train.compile_optimizer, cfg.engine.attention_groups) == (0, False, 4)
    assert cfg.lora.branch_dtype == "float32"  # a float32 model: mlx-lm's product
    assert cfg.engine.memory_budget_gb * GIB == ram  # exact: the plan gets the bytes it computed before
    assert cfg.model.dtype == "float32"  # the dtype whose plan is auto's here (models.load.dtype_plan)


@pytest.mark.parametrize("kind, groups", [("cuda", 1), ("metal", 4), ("cpu", 4)])
def test_attention_groups_auto_is_one_call_on_cuda_only(monkeypatch, kind, groups):
    """CUDA pays a setup per new attention-call shape; Metal trains attention through MLX's
    unfused graph, as the CPU does, so the grouped calls remove work there."""
    import dtrain.device as device

    monkeypatch.setattr(device, "backend", lambda: kind)
    assert device.default_attention_groups() == groups


def test_explicit_values_are_kept_and_not_reported():
    given = load_config(None, ["data.demo_pairs=1", "model.dtype=float32", "engine.length_bucket=64",
                               "engine.memory_budget_gb=3", "train.compile_optimizer=true",
                               "engine.kernels=mlx", "engine.attention_groups=2", "lora.branch_dtype=float32"])
    cfg, choices = resolve_auto(given)
    assert choices == {} and cfg == given
    reference, choices = resolve_auto(load_config(None, ["data.demo_pairs=1", "engine.kind=reference",
                                                         "engine.length_bucket=0", "model.dtype=float32",
                                                         "train.compile_optimizer=false", "lora.branch_dtype=float32"]))
    assert choices == {}  # the memory budget only matters to the auto plan


def test_output_dir_names_its_parts():
    out = OutputDir(Path("runs/x"))
    assert [out.checkpoints, out.tb, out.adapters, out.data_cache, out.lock] == \
        [Path("runs/x") / n for n in ("checkpoints", "tb", "adapters", "data_cache", ".dtrain.lock")]
