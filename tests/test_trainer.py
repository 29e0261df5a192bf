"""The training loop on a tiny random model: adapter files, TensorBoard
scalars, determinism, gradient accumulation equivalence."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import make_pairs, make_tiny_model
from dtrain.config import load_config
from dtrain.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from dtrain.tracking import read_scalars
from dtrain.trainer import train


def run(tmp_path, *overrides, seed=0):
    cfg = load_config(None, [
        f"train.output_dir={tmp_path}", "data.demo_pairs=1", "train.steps=4", "train.global_batch_pairs=4",
        "train.micro_batch_pairs=4", "train.learning_rate=1e-2", "lora.rank=2", "train.progress=false",
        "train.eval_every=2", *overrides,
    ])
    loaded = SimpleNamespace(model=make_tiny_model(seed=seed), tokenizer=None, identity="tiny", source="tiny-llama")
    pairs = make_pairs(12)
    dataset = SimpleNamespace(train=pairs[:9], valid=pairs[9:], fingerprint="fp")
    return train(cfg, loaded=loaded, dataset=dataset), loaded.model


def test_train_writes_mlx_lm_adapter_that_reloads(tmp_path):
    from mlx_lm.tuner.utils import load_adapters

    result, model = run(tmp_path)
    assert (result.adapter_dir / ADAPTER_WEIGHTS).is_file() and (result.adapter_dir / ADAPTER_CONFIG).is_file()
    assert all(np.isfinite(h["loss"]) for h in result.history) and len(result.history) == 4
    fresh = make_tiny_model(seed=0)
    x = mx.array([[1, 7, 8, 9, 10]])
    before = fresh(x)
    load_adapters(fresh, str(result.adapter_dir))
    model.eval()
    np.testing.assert_allclose(np.array(fresh(x)), np.array(model(x)), rtol=1e-5, atol=1e-5)
    assert float(mx.abs(fresh(x) - before).max()) > 1e-3  # the adapter changes the outputs


def test_tensorboard_scalars_read_back(tmp_path):
    result, _ = run(tmp_path)
    scalars = read_scalars(result.run_dir)
    for tag in ("loss", "nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen", "rewards/rejected",
                "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm",
                "learning_rate", "tokens_per_second", "pairs_per_second", "peak_memory_gb"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4], tag
    assert [s for s, _ in scalars["eval/loss"]] == [0, 2, 4]
    logged = [v for _, v in scalars["loss"]]
    np.testing.assert_allclose(logged, [h["loss"] for h in result.history], rtol=1e-6)


def test_two_runs_never_share_a_tensorboard_directory(tmp_path):
    from dtrain.tracking import new_run_dir

    dirs = [new_run_dir(tmp_path / "tb") for _ in range(3)]  # same second
    assert len(set(dirs)) == 3 and all(d.is_dir() and d.parent == tmp_path / "tb" for d in dirs)


def test_fresh_run_into_a_folder_with_checkpoints_is_refused(tmp_path):
    from dtrain.errors import UserError

    run(tmp_path, "train.steps=1")
    with pytest.raises(UserError, match="already holds checkpoints of an earlier run .newest step-0000001.; "
                                        "continue it with train.resume=auto"):
        run(tmp_path, "train.steps=2")
    resumed, _ = run(tmp_path, "train.steps=2", "train.resume=auto")
    assert len(resumed.history) == 1  # step 2 only


def test_same_seed_same_losses_and_adapter(tmp_path):
    a, _ = run(tmp_path / "a")
    b, _ = run(tmp_path / "b")
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    wa = mx.load(str(a.adapter_dir / ADAPTER_WEIGHTS))
    wb = mx.load(str(b.adapter_dir / ADAPTER_WEIGHTS))
    assert all(mx.array_equal(wa[k], wb[k]).item() for k in wa)


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """Micro-batches are weighted by their real token and pair counts: the
    summed gradient of 1-pair micro-batches equals the 4-pair batch's."""
    from dtrain.config import LoraConfig
    from dtrain.engine import ReferenceEngine
    from dtrain.lora import apply_lora
    from dtrain.trainer import global_norm, run_micro_batches

    model = make_tiny_model()
    apply_lora(model, LoraConfig(rank=2))
    model.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), model.trainable_parameters()))
    engine = ReferenceEngine(model, lam=0.1)
    pairs = make_pairs(4)
    norm = global_norm(pairs, "full")
    whole, g_whole = run_micro_batches(engine, pairs, norm, 4, with_grads=True)
    parts, g_parts = run_micro_batches(engine, pairs, norm, 1, with_grads=True)
    assert parts["pairs"] == whole["pairs"] == 4 and parts["nll_sum"] == pytest.approx(whole["nll_sum"], rel=1e-6)
    for (name, a), (_, b) in zip(tree_flatten(g_whole), tree_flatten(g_parts)):
        a, b = np.array(a), np.array(b)
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(a), name  # relative L2
    # and whole runs log the same losses (float32 rounding grows through Adam steps)
    a, _ = run(tmp_path / "a", "train.micro_batch_pairs=4")
    b, _ = run(tmp_path / "b", "train.micro_batch_pairs=1")
    assert a.history[0]["loss"] == pytest.approx(b.history[0]["loss"], rel=1e-6)
    np.testing.assert_allclose([h["loss"] for h in a.history], [h["loss"] for h in b.history], rtol=1e-4)


def test_first_adamw_step_is_bias_corrected(tmp_path):
    """Standard AdamW: the first update is lr * g / (|g| + eps) = lr * sign(g).
    (Without bias correction it would be lr * 0.1 / sqrt(0.001) = 3.16 lr.)"""
    result, model = run(tmp_path, "train.steps=1", "train.grad_clip=0", "train.schedule=constant",
                        "train.warmup_steps=0", "train.learning_rate=1e-2", "train.eval_every=0")
    weights = mx.load(str(result.adapter_dir / "adapters.safetensors"))
    lora_b = np.concatenate([np.abs(np.array(v)).ravel() for k, v in weights.items() if k.endswith("lora_b")])
    assert lora_b.max() == pytest.approx(1e-2, rel=1e-3)  # lora_b starts at 0
    assert np.median(lora_b) > 0.9e-2
