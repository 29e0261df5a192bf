"""rsLoRA, LoRA+ and train.init_adapter: the exact scale of every LoRA layer, the
learning rate of every parameter, and an initial adapter's weights as the step-0 weights."""

import json
import math
from types import SimpleNamespace

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.tuner.lora import LoRALinear

from conftest import DAMAGED_HEADERS, add_random_lora, damaged_header, make_pairs, make_tiny_model
from dtrain.config import LoraConfig, load_config
from dtrain.errors import ConfigError
from dtrain.files import StorageError
from dtrain.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, apply_lora, lora_from_adapter, save_adapter
from dtrain.run.optimizer import AdamWStep
from dtrain.run.trainer import Hooks, train


def lora_layers(model):
    return [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]


@pytest.mark.parametrize("rank, scale", [(4, 16.0), (8, 20.0), (2, 1.0)])
def test_rslora_scale_is_alpha_over_sqrt_rank_in_every_layer_and_in_the_adapter(tmp_path, rank, scale):
    model = make_tiny_model(seed=0)
    cfg = LoraConfig(rank=rank, scale=scale, rslora=True)
    apply_lora(model, cfg)
    layers = lora_layers(model)
    assert layers and all(m.scale == scale / math.sqrt(rank) for m in layers)
    save_adapter(model, cfg, tmp_path / "a")
    written = json.loads((tmp_path / "a" / ADAPTER_CONFIG).read_text())["lora_parameters"]
    assert written["scale"] == scale / math.sqrt(rank) and written["rank"] == rank
    plain = make_tiny_model(seed=0)
    apply_lora(plain, LoraConfig(rank=rank, scale=scale))
    assert all(m.scale == scale for m in lora_layers(plain))


def test_rslora_adapter_loads_in_mlx_lm_with_the_same_outputs(tmp_path):
    from mlx_lm.tuner.utils import load_adapters

    model = make_tiny_model(seed=0)
    cfg = LoraConfig(rank=4, scale=8.0, rslora=True)
    apply_lora(model, cfg)
    mx.random.seed(3)
    model.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), model.trainable_parameters()))
    save_adapter(model, cfg, tmp_path / "a")
    fresh = make_tiny_model(seed=0)
    load_adapters(fresh, str(tmp_path / "a"))
    x = mx.array([[1, 7, 8, 9, 10]])
    model.eval()
    np.testing.assert_allclose(np.array(fresh(x)), np.array(model(x)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_lora_plus_gives_lora_b_ratio_times_the_learning_rate(compiled):
    """One AdamW step (weight decay on): lora_b moves as AdamW with lr * ratio, lora_a as with lr."""
    ratio, lr = 16.0, 1e-3
    cfg = load_config(None, ["data.demo_pairs=1", f"train.learning_rate={lr}", "train.weight_decay=0.1",
                             "train.grad_clip=0", f"train.compile_optimizer={str(compiled).lower()}"]).train
    model = add_random_lora(make_tiny_model(seed=1), seed=2)
    params = model.trainable_parameters()
    leaves = tree_flatten(params)
    grads = tree_unflatten([(k, mx.random.normal(v.shape, key=mx.random.key(i))) for i, (k, v) in enumerate(leaves)])
    step = AdamWStep(cfg, params, plus_ratio=ratio)
    step.apply(model, grads, lr, True)
    got = dict(tree_flatten(model.trainable_parameters()))
    for name, p in leaves:  # each parameter against its own AdamW at its own learning rate
        want_lr = lr * ratio if name.endswith("lora_b") else lr
        adamw = optim.AdamW(learning_rate=want_lr, weight_decay=0.1, bias_correction=True)
        g = dict(tree_flatten(grads))[name]
        want = adamw.apply_gradients({"p": g}, {"p": p})["p"]
        np.testing.assert_allclose(np.array(got[name]), np.array(want), rtol=1e-5, atol=1e-7)
        assert not np.allclose(np.array(got[name]), np.array(p))
    assert any(n.endswith("lora_b") for n, _ in leaves) and any(n.endswith("lora_a") for n, _ in leaves)


def write_adapter(folder, rank=4, scale=3.0, keys=None, num_layers=-1, seed=5):
    model = make_tiny_model(seed=0)
    cfg = LoraConfig(rank=rank, scale=scale, keys=keys, num_layers=num_layers)
    apply_lora(model, cfg)
    mx.random.seed(seed)
    model.update(tree_map(lambda p: 0.05 * mx.random.normal(p.shape), model.trainable_parameters()))
    save_adapter(model, cfg, folder)
    return {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}


def run(out, *overrides, hooks=Hooks()):
    cfg = load_config(None, [
        f"train.output_dir={out}", "data.demo_pairs=1", "train.steps=2", "train.global_batch_pairs=4",
        "train.micro_batch_pairs=4", "train.learning_rate=1e-2", "lora.rank=2", "train.progress=false", *overrides])
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=None, identity="tiny", source="tiny-llama",
                             reference={"path": "tiny-llama"})
    pairs = make_pairs(12, seed=0)
    return train(cfg, loaded=loaded, dataset=SimpleNamespace(train=pairs[:9], valid=pairs[9:], fingerprint="fp"),
                 hooks=hooks), loaded.model


@pytest.mark.parametrize("kind", ["orpo", "dpo"])
def test_init_adapter_weights_are_the_step_0_weights_with_its_rank_scale_and_keys(tmp_path, kind):
    keys = ["self_attn.q_proj", "self_attn.v_proj"]
    weights = write_adapter(tmp_path / "init", rank=4, scale=3.0, keys=keys, num_layers=1)
    seen = {}

    def before_step(step, run_):
        if step == 1:
            seen.update({k: np.array(v) for k, v in tree_flatten(run_.model.trainable_parameters())})

    result, model = run(tmp_path / "out", f"train.init_adapter={tmp_path / 'init'}", f"objective.kind={kind}",
                        hooks=Hooks(before_step=before_step))
    assert seen.keys() == weights.keys()
    assert all(np.array_equal(seen[k], weights[k]) for k in weights)  # bit for bit
    assert all(m.scale == 3.0 for m in lora_layers(model)) and len(lora_layers(model)) == 2  # q, v of one layer
    written = json.loads((result.adapter_dir / ADAPTER_CONFIG).read_text())
    assert written["lora_parameters"]["rank"] == 4 and written["lora_parameters"]["keys"] == keys
    assert written["num_layers"] == 1
    if kind == "dpo":  # the reference is the model with the initial adapter: step 1's loss is ln 2
        assert result.history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_a_resume_compares_the_init_adapter_by_its_weights_not_its_path(tmp_path):
    """A resume compared train.init_adapter by its text: new weights in the same folder went on (dpo then
    recomputed its reference from them, another loss), the same weights moved were refused."""
    import shutil

    from dtrain.errors import UserError

    write_adapter(tmp_path / "init", rank=4, scale=3.0)
    stop = Hooks(before_step=lambda step, run_: setattr(run_.stop, "requested", step == 2))
    run(tmp_path / "out", f"train.init_adapter={tmp_path / 'init'}", "objective.kind=dpo", "train.steps=4", hooks=stop)
    shutil.copytree(tmp_path / "init", tmp_path / "moved")
    write_adapter(tmp_path / "init", rank=4, scale=3.0, seed=6)  # other weights, same shapes, same path
    with pytest.raises(UserError, match=r"train.init_adapter: '[0-9a-f]{64}' in the checkpoint, '[0-9a-f]{64}' now"):
        run(tmp_path / "out", f"train.init_adapter={tmp_path / 'init'}", "objective.kind=dpo", "train.steps=4",
            "train.resume=auto")
    result, _ = run(tmp_path / "out", f"train.init_adapter={tmp_path / 'moved'}", "objective.kind=dpo",
                    "train.steps=4", "train.resume=auto")
    assert result.steps == 4 and len(result.history) == 2  # steps 3 and 4, after the checkpoint of step 2


def test_a_dpo_run_again_with_the_init_adapters_scale_changed_does_not_read_the_stale_reference(tmp_path):
    """The reference cache was keyed by the initial adapter's weights file only: a run that ended before its
    first save, started again after adapter_config.json's scale changed (same weights), read the old
    model's reference log-probs, so step 1's DPO loss was not ln 2 (0.69408 here)."""
    write_adapter(tmp_path / "init", rank=4, scale=3.0)

    def crash(step, run_):
        raise RuntimeError("out of memory")

    with pytest.raises(Exception, match="out of memory"):
        run(tmp_path / "out", f"train.init_adapter={tmp_path / 'init'}", "objective.kind=dpo",
            hooks=Hooks(before_step=crash))
    meta = json.loads((tmp_path / "init" / ADAPTER_CONFIG).read_text())
    meta["lora_parameters"]["scale"] = 9.0
    (tmp_path / "init" / ADAPTER_CONFIG).write_text(json.dumps(meta))
    result, _ = run(tmp_path / "out", f"train.init_adapter={tmp_path / 'init'}", "objective.kind=dpo")
    assert result.history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert result.history[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert len(list((tmp_path / "out" / "data_cache").glob("reference-*-train.npz"))) == 2


def test_init_adapter_says_which_lora_keys_it_replaces(tmp_path, capsys):
    """--lora.rank 2 with an init adapter of rank 4 trained rank 4 without a word; now one notice
    names each key the config set that the adapter replaced (keys left at their defaults are not named)."""
    write_adapter(tmp_path / "init", rank=4, scale=3.0)
    run(tmp_path / "out", f"train.init_adapter={tmp_path / 'init'}", "lora.scale=3.0")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.init_adapter")]
    assert lines == [f"train.init_adapter {tmp_path / 'init'} sets the LoRA's shape: lora.rank 2 -> 4 "
                     "(the adapter's values are trained, not the config's)"]
    write_adapter(tmp_path / "same", rank=2, scale=20.0)
    run(tmp_path / "out2", f"train.init_adapter={tmp_path / 'same'}")
    assert "sets the LoRA" not in capsys.readouterr().err


def test_init_adapter_config_errors_name_the_folder(tmp_path):
    write_adapter(tmp_path / "a")
    for name, what in (("nowhere", "no such folder"), ("a/adapters.safetensors", "a file, not an adapter folder")):
        with pytest.raises(ConfigError) as err:  # a missing folder read "no adapters.safetensors"
            lora_from_adapter(LoraConfig(), tmp_path / name)
        assert str(err.value) == f"train.init_adapter {tmp_path / name}: {what} (an mlx-lm adapter folder is expected)"
    (tmp_path / "a" / "adapters.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"train.init_adapter .*a: no adapters.safetensors"):
        lora_from_adapter(LoraConfig(), tmp_path / "a")
    write_adapter(tmp_path / "run" / "adapters")  # a run's output folder given for its adapter
    with pytest.raises(ConfigError) as err:
        lora_from_adapter(LoraConfig(), tmp_path / "run")
    assert str(err.value) == (f"train.init_adapter {tmp_path / 'run'}: no adapters.safetensors (expected an mlx-lm "
                              f"adapter folder); {tmp_path / 'run'} is a run's output folder: its adapter is "
                              f"{tmp_path / 'run' / 'adapters'}")
    write_adapter(tmp_path / "a")
    (tmp_path / "a" / ADAPTER_CONFIG).write_text("{}")
    with pytest.raises(ConfigError, match=r"adapter_config.json has no readable lora_parameters"):
        lora_from_adapter(LoraConfig(), tmp_path / "a")
    (tmp_path / "a" / ADAPTER_CONFIG).write_text("[" * 5000 + "]" * 5000)  # RecursionError's traceback
    with pytest.raises(ConfigError) as err:
        lora_from_adapter(LoraConfig(), tmp_path / "a")
    assert str(err.value) == (f"train.init_adapter {tmp_path / 'a'}: {ADAPTER_CONFIG} has no readable lora_parameters "
                              "rank and scale (nested too deep for Python's recursion limit)")
    (tmp_path / "a" / ADAPTER_CONFIG).unlink()
    (tmp_path / "a" / ADAPTER_CONFIG).mkdir()  # an OSError other than a missing file was a traceback
    with pytest.raises(ConfigError) as err:
        lora_from_adapter(LoraConfig(), tmp_path / "a")
    assert str(err.value) == f"train.init_adapter {tmp_path / 'a'}: cannot read {ADAPTER_CONFIG} (Is a directory)"


@pytest.mark.parametrize("meta, error", [
    ({"num_layers": 2, "lora_parameters": {"rank": 4, "scale": 0.0}}, "lora_parameters.scale must be > 0; got 0.0"),
    ({"num_layers": 2, "lora_parameters": {"rank": 0, "scale": 2.0}}, "lora_parameters.rank must be > 0; got 0"),
    ({"num_layers": "all", "lora_parameters": {"rank": 4, "scale": 2.0}}, "num_layers: expected int, got 'all'"),
    ({"num_layers": 2, "lora_parameters": {"rank": 4, "scale": 2.0, "keys": "self_attn.q_proj"}},
     "lora_parameters.keys: expected list, got 'self_attn.q_proj'"),
])
def test_init_adapter_values_outside_the_lora_keys_bounds_are_refused_naming_them(tmp_path, meta, error):
    """The adapter's values replace lora.rank, scale, num_layers and keys, so they meet the same bounds:
    before, a scale of 0 trained nothing (every LoRA gradient is 0) and num_layers "all" raised ValueError."""
    write_adapter(tmp_path / "a")
    (tmp_path / "a" / ADAPTER_CONFIG).write_text(json.dumps({"fine_tune_type": "lora", **meta}))
    with pytest.raises(ConfigError) as err:
        lora_from_adapter(LoraConfig(), tmp_path / "a")
    assert str(err.value) == f"train.init_adapter {tmp_path / 'a'}: {ADAPTER_CONFIG} {error}"


@pytest.mark.parametrize("keys, error", [
    ([], "[] matched no linear layer of the model"),
    (["input_layernorm"], "['input_layernorm']: Can't convert layer of type RMSNorm to LoRA; name linear layers, "
                          "e.g. [self_attn.q_proj, mlp.down_proj]"),
    ([["self_attn.q_proj"], "mlp.up"], "[['self_attn.q_proj'], 'mlp.up']: no module named ['self_attn.q_proj'], "
                                       "'mlp.up'; the decoder layers' linear layers are mlp.down_proj, mlp.gate_proj, "
                                       "mlp.up_proj, self_attn.k_proj, self_attn.o_proj, self_attn.q_proj, "
                                       "self_attn.v_proj"),
])
def test_init_adapter_keys_that_fit_no_linear_layer_are_named_as_the_adapters(tmp_path, keys, error):
    """The adapter's lora_parameters.keys replace lora.keys, and the message blamed lora.keys (which the
    user never set): it names the adapter's adapter_config.json."""
    write_adapter(tmp_path / "a")
    meta = {"fine_tune_type": "lora", "num_layers": 4, "lora_parameters": {"rank": 4, "scale": 3.0, "keys": keys}}
    (tmp_path / "a" / ADAPTER_CONFIG).write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as err:
        run(tmp_path / "out", f"train.init_adapter={tmp_path / 'a'}")
    assert str(err.value) == f"train.init_adapter {tmp_path / 'a'}: {ADAPTER_CONFIG} lora_parameters.keys {error}"


def test_a_damaged_init_adapter_weights_file_is_one_line_naming_it(tmp_path, capsys):
    """A truncated adapters.safetensors raised MLX's RuntimeError (a traceback from `dtrain train`)."""
    write_adapter(tmp_path / "a")
    weights = tmp_path / "a" / ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(StorageError) as err:
        run(tmp_path / "out", f"train.init_adapter={tmp_path / 'a'}")
    assert str(err.value).startswith(f"could not read train.init_adapter {weights}: [load_safetensors] ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("header, reason", DAMAGED_HEADERS)
def test_an_init_adapter_weights_file_with_a_damaged_header_is_one_line(tmp_path, header, reason):
    """A header that is not JSON or not of safetensors' shape ended `dtrain train` in MLX's RuntimeError traceback."""
    write_adapter(tmp_path / "a")
    weights = tmp_path / "a" / ADAPTER_WEIGHTS
    weights.write_bytes(damaged_header(header))
    with pytest.raises(StorageError) as err:
        run(tmp_path / "out", f"train.init_adapter={tmp_path / 'a'}")
    assert str(err.value).startswith(f"could not read train.init_adapter {weights}: {reason}")
    assert not (tmp_path / "out").exists()


def test_lora_keys_naming_a_module_that_is_not_linear_is_one_line():
    """mlx-lm's ValueError ("Can't convert layer of type RMSNorm to LoRA") was a traceback from `dtrain train`."""
    with pytest.raises(ConfigError) as err:
        apply_lora(make_tiny_model(seed=0), LoraConfig(keys=["self_attn.q_proj", "input_layernorm"]))
    assert str(err.value) == ("lora.keys ['self_attn.q_proj', 'input_layernorm']: Can't convert layer of type RMSNorm "
                              "to LoRA; name linear layers, e.g. [self_attn.q_proj, mlp.down_proj]")


def test_lora_keys_naming_no_module_of_the_model_are_refused_naming_them():
    """A key that names no module (a typo beside valid keys) was dropped without a word: [self_attn.q_prj,
    self_attn.v_proj] trained v_proj only. A key of some decoder layers only (Gemma 4's k_proj, absent from its
    KV-shared layers) or of the model itself (lm_head, as mlx-lm reads keys) is a module of the model."""
    with pytest.raises(ConfigError) as err:
        apply_lora(make_tiny_model(seed=0), LoraConfig(keys=["self_attn.q_prj", "self_attn.v_proj", "mlp.up"]))
    assert str(err.value) == ("lora.keys ['self_attn.q_prj', 'self_attn.v_proj', 'mlp.up']: no module named "
                              "'self_attn.q_prj', 'mlp.up'; the decoder layers' linear layers are mlp.down_proj, "
                              "mlp.gate_proj, mlp.up_proj, self_attn.k_proj, self_attn.o_proj, self_attn.q_proj, "
                              "self_attn.v_proj")
    from test_engine_gemma4 import GEMMA4

    gemma4 = make_tiny_model("gemma4_text", seed=0, **GEMMA4)
    apply_lora(gemma4, LoraConfig(rank=2, keys=["self_attn.k_proj"]))
    adapted = [i for i, layer in enumerate(gemma4.layers) if isinstance(layer.self_attn.get("k_proj"), LoRALinear)]
    assert adapted == [0, 1, 2, 3]
    untied = make_tiny_model(seed=0, tie_word_embeddings=False)
    apply_lora(untied, LoraConfig(rank=2, keys=["self_attn.q_proj", "lm_head"]))
    assert isinstance(untied.lm_head, LoRALinear) and len(lora_layers(untied)) == 5


def test_lora_keys_of_no_adapted_layer_name_the_layers_num_layers_adapts():
    """Gemma 4's KV-shared layers have no k_proj: k_proj on its last 2 layers matched nothing, and the message
    said "matched no linear layer of the model", which has four; it names the layers adapted."""
    from test_engine_gemma4 import GEMMA4

    with pytest.raises(ConfigError) as err:
        apply_lora(make_tiny_model("gemma4_text", seed=0, **GEMMA4),
                   LoraConfig(keys=["self_attn.k_proj"], num_layers=2))
    assert str(err.value) == ("lora.keys ['self_attn.k_proj'] matched no linear layer of the last 2 of the model's 6 "
                              "decoder layers (num_layers 2)")


def test_init_adapter_with_other_tensors_is_refused_naming_them(tmp_path):
    write_adapter(tmp_path / "a")
    w = mx.load(str(tmp_path / "a" / ADAPTER_WEIGHTS))
    w.pop(sorted(w)[0])
    mx.save_safetensors(str(tmp_path / "a" / ADAPTER_WEIGHTS), w)
    with pytest.raises(ConfigError, match=r"do not match the model's LoRA parameters \(missing: model.layers"):
        run(tmp_path / "out", f"train.init_adapter={tmp_path / 'a'}")


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_init_adapter_with_non_finite_weights_is_refused_naming_the_tensor(tmp_path, value):
    """A NaN or inf in the initial adapter trained nothing: every step was skipped as non-finite and the adapter
    written at the end held the NaN."""
    write_adapter(tmp_path / "a")
    w = mx.load(str(tmp_path / "a" / ADAPTER_WEIGHTS))
    name = sorted(w)[1]
    w[name] = mx.where(mx.arange(w[name].size).reshape(w[name].shape) == 3, value, w[name])
    mx.save_safetensors(str(tmp_path / "a" / ADAPTER_WEIGHTS), w)
    with pytest.raises(ConfigError) as err:
        run(tmp_path / "out", f"train.init_adapter={tmp_path / 'a'}")
    assert str(err.value) == (f"train.init_adapter {tmp_path / 'a' / ADAPTER_WEIGHTS}: {name} holds 1 non-finite "
                              f"value(s) (NaN or inf); an adapter to start from must be finite")
    assert not (tmp_path / "out" / "adapters").exists()


def test_rslora_adapter_exports_with_dtrain_export(tmp_path):
    """The merged model of an rsLoRA adapter (dtrain export) gives the LoRA model's logits."""
    from mlx_lm import load

    from dtrain.models import load_model
    from dtrain.models.export import export_adapter
    from test_models_gguf import write_tiny_llama

    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {})
    model = load_model(str(base), dtype="float32").model
    cfg = LoraConfig(rank=4, scale=8.0, rslora=True)
    apply_lora(model, cfg)
    mx.random.seed(4)
    model.update(tree_map(lambda p: 0.05 * mx.random.normal(p.shape), model.trainable_parameters()))
    save_adapter(model, cfg, tmp_path / "adapter")
    model.eval()
    tokens = mx.array([[1, 3, 40, 7, 300, 99]])
    result = export_adapter(str(tmp_path / "adapter"), str(base), str(tmp_path / "out"), gguf_type="f32",
                            dtype="float32")
    merged, _ = load(str(result.folder))
    np.testing.assert_allclose(np.array(merged(tokens)), np.array(model(tokens)), rtol=1e-4, atol=1e-4)


def _branch_layer(dtype, branch_dtype="auto", seed=0):
    """One LoRA linear (48 -> 40, rank 4, scale 3) of ``dtype`` through apply_lora, with non-zero factors."""
    import mlx.nn as nn

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Module()]
            self.layers[0].proj = nn.Linear(48, 40, bias=False)

    mx.random.seed(seed)
    model = One()
    model.set_dtype(dtype)
    apply_lora(model, LoraConfig(rank=4, scale=3.0, branch_dtype=branch_dtype))
    layer = model.layers[0].proj
    layer.lora_b = 0.1 * mx.random.normal(layer.lora_b.shape)
    return model, layer


def _value_and_grads(model, layer, x):
    import mlx.nn as nn

    def loss(m, x):
        return (layer(x).astype(mx.float32) ** 2).sum()

    value, grads = nn.value_and_grad(model, loss)(model, x)
    return value, grads["layers"][0]["proj"]


def test_bfloat16_model_runs_the_low_rank_product_in_bfloat16_from_float32_factors():
    """``branch_dtype: auto`` on a bfloat16 model: the product is ``x @ bf16(A) @ bf16(scale B)`` exactly, the
    factors and their gradients stay float32, and the gradients are within bfloat16 rounding of the float32
    product's (mlx-lm's path, ``branch_dtype: float32``), which differs."""
    from dtrain.lora import BranchLoRALinear

    model, layer = _branch_layer(mx.bfloat16)
    plain_model, plain = _branch_layer(mx.bfloat16, "float32")
    assert type(layer) is BranchLoRALinear and type(plain) is LoRALinear
    assert layer.lora_a.dtype == mx.float32 and layer.linear.weight.dtype == mx.bfloat16
    x = mx.random.normal((2, 6, 48), key=mx.random.key(1)).astype(mx.bfloat16)
    y = layer(x)
    by_hand = layer.linear(x) + (x @ layer.lora_a.astype(mx.bfloat16)) @ (3.0 * layer.lora_b).astype(mx.bfloat16)
    assert y.dtype == mx.bfloat16 and mx.array_equal(y, by_hand).item()
    assert not mx.array_equal(y, plain(x)).item()  # mlx-lm's float32 product rounds differently
    _, g = _value_and_grads(model, layer, x)
    _, g32 = _value_and_grads(plain_model, plain, x)
    for name in ("lora_a", "lora_b"):
        assert g[name].dtype == mx.float32
        a, b = np.array(g[name]), np.array(g32[name])
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2, name
        assert np.linalg.norm(b) > 0


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_float32_and_float16_models_keep_mlx_lms_lora_product_bitwise(dtype):
    """Only bfloat16 activations take the bfloat16 product: a float32 model (the CPU's) and a float16 one
    give mlx-lm's outputs and gradients bit for bit."""
    model, layer = _branch_layer(dtype)
    plain_model, plain = _branch_layer(dtype, "float32")
    x = mx.random.normal((2, 6, 48), key=mx.random.key(2)).astype(dtype)
    assert mx.array_equal(layer(x), plain(x)).item()
    _, g = _value_and_grads(model, layer, x)
    _, g32 = _value_and_grads(plain_model, plain, x)
    assert all(mx.array_equal(g[k], g32[k]).item() for k in ("lora_a", "lora_b"))
