"""The optimizer step (dtrain/run/optimizer.py): compiled = eager mlx.optimizers AdamW
with clipping and a schedule; a non-finite step leaves parameters and state
untouched; a resumed compiled run equals an uninterrupted one bitwise."""

import shutil

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from conftest import add_random_lora, make_tiny_model
from dtrain.config import load_config
from dtrain.run.optimizer import AdamWStep
from dtrain.run.optimizer import learning_rate

STEPS = 6


def train_cfg(*overrides):
    return load_config(None, ["data.demo_pairs=1", f"train.steps={STEPS}", "train.warmup_steps=2",
                              "train.schedule=cosine", "train.learning_rate=1e-2", "train.weight_decay=0.1",
                              *overrides]).train


def lora_model():
    return add_random_lora(make_tiny_model(seed=1), seed=2)


def random_grads(model, step, seed=0):
    """Gradients of the LoRA shapes, N(0, 1): their norm (~40) is far above a clip of 0.5."""
    key = mx.random.key(1000 * seed + step)
    leaves = tree_flatten(model.trainable_parameters())
    keys = mx.random.split(key, len(leaves))
    return tree_unflatten([(k, mx.random.normal(v.shape, key=keys[i])) for i, (k, v) in enumerate(leaves)])


def eager_reference(cfg, model):
    """The trainer's former path: mlx.optimizers.AdamW, clip_grad_norm, then update."""
    opt = optim.AdamW(learning_rate=learning_rate(1, cfg), weight_decay=cfg.weight_decay, bias_correction=True)
    opt.init(model.trainable_parameters())

    def step(grads, lr):
        if cfg.grad_clip > 0:
            grads, norm = optim.clip_grad_norm(grads, cfg.grad_clip)
        else:
            norm = mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for _, g in tree_flatten(grads)))
        opt.learning_rate = lr
        opt.update(model, grads)
        mx.eval(model.trainable_parameters(), opt.state)
        return float(norm)

    return opt, step


def flat(tree):
    return {k: np.array(v) for k, v in tree_flatten(tree)}


def assert_close(a: dict, b: dict, rel: float):
    """Every array of ``a`` equals ``b``'s to ``rel`` in relative L2 (0: bitwise, dtype included)."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if rel == 0:
            assert np.array_equal(a[k], b[k]), k
        else:
            assert np.linalg.norm(a[k] - b[k]) <= rel * np.linalg.norm(a[k]), k


@pytest.mark.parametrize("clip", [0.5, 0.0])
@pytest.mark.parametrize("compiled", [True, False])
def test_step_equals_eager_adamw_with_clipping_and_schedule(clip, compiled):
    """Six steps of warmup + cosine, weight decay, clipping active (norms ~40 > 0.5)
    or off: the same parameters, moments, step counter and learning rate as
    mlx.optimizers.AdamW applied eagerly; uncompiled it is that path (bitwise),
    compiled within 1e-6 relative (fused kernels may round differently; on this
    CPU it is bitwise too)."""
    cfg = train_cfg(f"train.grad_clip={clip}", f"train.compile_optimizer={str(compiled).lower()}")
    ref_model, model = lora_model(), lora_model()
    ref_opt, ref_step = eager_reference(cfg, ref_model)
    opt = AdamWStep(cfg, model.trainable_parameters())
    lrs = [learning_rate(s, cfg) for s in range(1, STEPS + 1)]
    assert len(set(lrs)) == STEPS  # the schedule moves every step
    for s, lr in enumerate(lrs, start=1):
        grads = random_grads(model, s)
        ref_norm = ref_step(grads, lr)
        norm, applied = opt.apply(model, grads, lr, loss_finite=True)
        assert norm == pytest.approx(ref_norm, rel=1e-6) and applied
        assert clip == 0 or ref_norm > 10 * clip  # clipping is active
    rel = 1e-6 if compiled else 0
    assert_close(flat(ref_model.trainable_parameters()), flat(model.trainable_parameters()), rel)
    assert_close(flat(ref_opt.state), flat(opt.state), rel)
    assert opt.state["step"].item() == STEPS and opt.state["step"].dtype == mx.uint64
    assert opt.state["learning_rate"].item() == np.float32(lrs[-1])


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("bad", ["inf gradient", "nan gradient", "loss"])
def test_non_finite_step_changes_nothing(compiled, bad):
    """Step 2 has a non-finite gradient norm (one inf or nan entry) or a
    non-finite loss: parameters, moments, step counter and learning rate stay
    bitwise as after step 1, ``applied`` is False; step 3 then equals the eager
    path that never saw step 2."""
    cfg = train_cfg(f"train.compile_optimizer={str(compiled).lower()}")
    ref_model, model = lora_model(), lora_model()
    ref_opt, ref_step = eager_reference(cfg, ref_model)
    opt = AdamWStep(cfg, model.trainable_parameters())
    grads = random_grads(model, 1)
    ref_step(grads, learning_rate(1, cfg))
    opt.apply(model, grads, learning_rate(1, cfg), True)
    before, state_before = flat(model.trainable_parameters()), flat(opt.state)

    grads = random_grads(model, 2)
    if bad != "loss":
        name = next(k for k, _ in tree_flatten(grads) if k.endswith("lora_a"))
        poisoned = np.array(dict(tree_flatten(grads))[name])
        poisoned[0, 0] = np.inf if bad == "inf gradient" else np.nan
        grads = tree_unflatten([(k, mx.array(poisoned) if k == name else v) for k, v in tree_flatten(grads)])
    loss_finite = bad != "loss"
    norm, applied = opt.apply(model, grads, learning_rate(2, cfg), loss_finite)
    assert not applied
    assert (bad == "loss") == np.isfinite(norm)
    assert_close(before, flat(model.trainable_parameters()), 0)
    assert_close(state_before, flat(opt.state), 0)
    assert opt.state["step"].item() == 1 and opt.state["learning_rate"].item() == np.float32(learning_rate(1, cfg))

    grads = random_grads(model, 3)
    ref_step(grads, learning_rate(3, cfg))
    opt.apply(model, grads, learning_rate(3, cfg), True)
    rel = 1e-6 if compiled else 0
    assert_close(flat(ref_model.trainable_parameters()), flat(model.trainable_parameters()), rel)
    assert_close(flat(ref_opt.state), flat(opt.state), rel)


@pytest.mark.parametrize("compiled", [True, False])
def test_an_update_that_would_make_the_weights_non_finite_is_skipped(compiled):
    """A finite loss and gradient, but a learning rate of 1e38 (AdamW's bias correction divides it by 0.19 at
    step 2: inf in float32) made LoRA weights inf or NaN, and the adapter written held them: the step is skipped
    as a non-finite one, parameters and state bitwise as before."""
    cfg = train_cfg(f"train.compile_optimizer={str(compiled).lower()}")
    model = lora_model()
    opt = AdamWStep(cfg, model.trainable_parameters())
    opt.apply(model, random_grads(model, 1), learning_rate(1, cfg), True)
    before, state_before = flat(model.trainable_parameters()), flat(opt.state)
    norm, applied = opt.apply(model, random_grads(model, 2), 1e38, True)
    assert np.isfinite(norm) and not applied
    assert_close(before, flat(model.trainable_parameters()), 0)
    assert_close(state_before, flat(opt.state), 0)


def test_compiled_step_traces_once():
    """The LoRA shapes never change: one trace for a whole run, a fresh state and a restored one (as
    checkpoints restore it, without empty placeholders) included, and for a skipped step."""
    cfg = train_cfg("train.compile_optimizer=true")
    model = lora_model()
    opt = AdamWStep(cfg, model.trainable_parameters())
    traces = []
    pure = opt._pure
    assert opt.compiled is not None

    def counting(*args):
        traces.append(1)
        return pure(*args)

    opt.compiled = mx.compile(counting)
    for s in range(1, 4):
        opt.apply(model, random_grads(model, s), learning_rate(s, cfg), s != 2)
    opt.state = tree_unflatten(list(flat(opt.state).items()))  # as dtrain.run.checkpoint.restore sets it
    opt.state = tree_map(mx.array, opt.state)
    opt.apply(model, random_grads(model, 4), learning_rate(4, cfg), True)
    assert opt.state["step"].item() == 3
    assert len(traces) <= 2  # once, and at most once more for the restored tree's structure


def test_resume_of_a_compiled_run_is_bitwise_uninterrupted(tmp_path):
    """Clipping active (0.05), warmup + cosine: 6 steps in one go against 3 steps,
    a checkpoint, and 3 more resumed from it: the same adapter and optimizer state, bit for bit."""
    from test_trainer import run

    args = ("train.steps=6", "train.grad_clip=0.05", "train.warmup_steps=2", "train.schedule=cosine",
            "train.eval_every=0", "train.compile_optimizer=true")
    whole, _ = run(tmp_path / "whole", *args)
    part, _ = run(tmp_path / "part", *args, "train.save_every=3")
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-0000006")
    shutil.rmtree(part.adapter_dir)
    resumed, _ = run(tmp_path / "part", *args, "train.save_every=3", "train.resume=auto")
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in whole.history[3:]]
    assert max(h["grad_norm"] for h in whole.history) > 0.05  # clipping was active
    for name in ("adapters/adapters.safetensors", "checkpoints/step-0000006/optimizer.safetensors"):
        a, b = mx.load(str(tmp_path / "whole" / name)), mx.load(str(tmp_path / "part" / name))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() and a[k].dtype == b[k].dtype
                                            for k in a), name


def test_a_shortened_run_ending_at_the_rate_shown_for_the_final_one_gets_no_notice():
    """train.steps 9999 of a cosine schedule planned for 10000: the notice read 'its last step trains at learning
    rate 5e-05, not the final 5e-05', two rates it shows as one; it comes where the rates differ as shown."""
    from dtrain.run.optimizer import shortened_notice

    cfg = load_config(None, ["data.demo_pairs=1", "train.steps=9999", "train.schedule=cosine",
                             "train.min_lr_ratio=0.1"]).train
    assert learning_rate(9999, cfg, 10000) != learning_rate(10000, cfg, 10000)
    assert shortened_notice(cfg, 10000) is None
    cfg = load_config(None, ["data.demo_pairs=1", "train.steps=9000", "train.schedule=cosine",
                             "train.min_lr_ratio=0.1"]).train
    assert shortened_notice(cfg, 10000) == ("train.steps 9000 ends this run before the 10000 steps its schedule was "
                                            "planned for: its last step trains at learning rate 6.1e-05, not the "
                                            "final 5e-05")
