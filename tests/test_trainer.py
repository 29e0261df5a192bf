"""The training loop on a tiny random model: adapter files, TensorBoard
scalars, determinism, gradient accumulation equivalence."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import make_pairs, make_tiny_model
from dtrain.run.checkpoint import RESUME_HINT
from dtrain.config import load_config
from dtrain.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from dtrain.run.tracking import read_scalars
from dtrain.run.trainer import train


def run(tmp_path, *overrides, seed=0, n_train=9, data_seed=0, hooks=None, n_valid=3):
    cfg = load_config(None, [
        f"train.output_dir={tmp_path}", "data.demo_pairs=1", "train.steps=4", "train.global_batch_pairs=4",
        "train.micro_batch_pairs=4", "train.learning_rate=1e-2", "lora.rank=2", "train.progress=false",
        "train.eval_every=2", *overrides,
    ])
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=seed), tokenizer=None, identity="tiny", source="tiny-llama",
                             reference={"path": "tiny-llama"})
    pairs = make_pairs(n_train + n_valid, seed=data_seed)
    dataset = SimpleNamespace(train=pairs[:n_train], valid=pairs[n_train:], fingerprint="fp")
    return train(cfg, loaded=loaded, dataset=dataset, **({"hooks": hooks} if hooks else {})), loaded.model


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
    # packed micro-batches at exact shapes (the CPU's default): no token computed is padding
    assert scalars["perf/padding_fraction"] == [(s, 0.0) for s in (1, 2, 3, 4)]
    logged = [v for _, v in scalars["loss"]]
    np.testing.assert_allclose(logged, [h["loss"] for h in result.history], rtol=1e-6)


def test_a_steps_scalars_are_one_tensorboard_event(tmp_path):
    """One record (and checksum) per step, not one per scalar: each is a pure-Python CRC in tensorboardX."""
    from dtrain.run.tracking import RunLogger, read_events

    log = RunLogger(tmp_path, total_steps=2, progress=False)
    log.scalars(1, {"loss": 0.5, "grad_norm": 2.25})
    log.scalars(2, {"loss": 0.25, "grad_norm": 1.0})
    log.close()
    steps = [(e.step, [(v.tag, v.simple_value) for v in e.summary.value]) for e in read_events(tmp_path) if e.summary.value]
    assert steps == [(1, [("loss", 0.5), ("grad_norm", 2.25)]), (2, [("loss", 0.25), ("grad_norm", 1.0)])]
    assert read_scalars(tmp_path) == {"loss": [(1, 0.5), (2, 0.25)], "grad_norm": [(1, 2.25), (2, 1.0)]}


def test_a_skipped_steps_nan_scalars_are_logged_without_tensorboardx_warnings(tmp_path, caplog):
    """A skipped step logs its non-finite metrics on purpose (its own line says it was skipped); tensorboardX's
    check warned "NaN or Inf found in input tensor." once per such scalar, about ten lines per step."""
    import math

    from dtrain.run.tracking import RunLogger

    log = RunLogger(tmp_path, total_steps=1, progress=False)
    with caplog.at_level("WARNING"):
        log.scalars(1, {"loss": math.nan, "grad_norm": math.inf, "learning_rate": 0.5})
    log.close()
    assert caplog.records == []
    got = read_scalars(tmp_path)
    assert math.isnan(got["loss"][0][1]) and got["grad_norm"] == [(1, math.inf)] and got["learning_rate"] == [(1, 0.5)]


def tensorboard_scalars(run_dir) -> dict:
    """tag -> [(step, value)] as TensorBoard's own loader shows a run folder (its Python path, the one on Apple
    Silicon, where tensorboard-data-server ships no binary)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.util import tensor_util

    acc = pea.EventAccumulator(str(run_dir), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"] if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}


def test_a_run_resumed_after_a_crash_shows_each_step_once_in_tensorboard(tmp_path):
    """Killed in step 4 after checkpoint 2, the first process had logged step 3: the resume's SessionLog.START
    (purge_step 3) must drop it. TensorBoard's loader takes a run's first START for the run's own start and
    purges only at a later one, so it showed step 3 twice while the first event file had no START."""
    from dtrain.run.trainer import Hooks

    class Crash(Exception):
        pass

    def crash_in_4(step, run_):
        if step == 4:
            raise Crash

    args = ("train.save_every=2", "train.schedule=constant")
    whole, _ = run(tmp_path / "whole", *args)
    with pytest.raises(Crash):
        run(tmp_path / "cut", *args, hooks=Hooks(before_step=crash_in_4))
    resumed, _ = run(tmp_path / "cut", *args, "train.resume=auto")
    shown, uninterrupted = tensorboard_scalars(resumed.run_dir), tensorboard_scalars(whole.run_dir)
    assert [s for s, _ in shown["loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in shown["eval/loss"]] == [0, 2, 4]
    assert shown["loss"] == uninterrupted["loss"]  # step 3 the resumed run's, equal to the uninterrupted run's
    assert read_scalars(resumed.run_dir)["loss"] == shown["loss"]  # dtrain's reader reads what TensorBoard shows


def test_two_runs_never_share_a_tensorboard_directory(tmp_path):
    from dtrain.run.tracking import new_run_dir

    dirs = [new_run_dir(tmp_path / "tb") for _ in range(3)]  # same second
    assert len(set(dirs)) == 3 and all(d.is_dir() and d.parent == tmp_path / "tb" for d in dirs)


def test_fresh_run_into_a_folder_with_checkpoints_is_refused(tmp_path):
    from dtrain.errors import UserError

    run(tmp_path, "train.steps=1")
    with pytest.raises(UserError, match="already holds checkpoints of an earlier run .newest step-0000001.; "
                                        "continue it with --train.resume auto"):
        run(tmp_path, "train.steps=2")
    resumed, _ = run(tmp_path, "train.steps=2", "train.resume=auto")
    assert len(resumed.history) == 1  # step 2 only


def test_a_damaged_only_checkpoint_beside_an_adapter_is_named(tmp_path):
    """resume=auto where the one checkpoint is damaged: the refusal said "no checkpoint to continue
    that run from" beside step-0000001, and the skip report was silenced; it now names it and why."""
    from dtrain.errors import UserError

    run(tmp_path, "train.steps=1")
    step = tmp_path / "checkpoints" / "step-0000001"
    (step / "adapters.safetensors").write_bytes(b"garbage")
    before = sorted((str(p), p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
    with pytest.raises(UserError) as err:
        run(tmp_path, "train.steps=2", "train.resume=auto")
    assert str(err.value) == (f"{tmp_path} holds an earlier run's adapter (adapters/) and no valid checkpoint "
                              f"(step-0000001: checksum mismatch in adapters.safetensors) to continue that run from, "
                              f"so this run would replace it; choose another train.output_dir, or remove "
                              f"{tmp_path / 'adapters'} to train anew here")
    assert sorted((str(p), p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()) == before


def test_a_run_into_an_adapter_folder_is_refused(tmp_path):
    """--train.output_dir runs/demo/adapters (the adapter, not the run folder): the run trained and wrote
    checkpoints/, tb/ and a nested adapters/ into the published adapter; it stops before writing anything."""
    from dtrain.errors import UserError

    run(tmp_path, "train.steps=1")
    adapter = tmp_path / "adapters"
    before = sorted((str(p), p.read_bytes()) for p in adapter.rglob("*") if p.is_file())
    with pytest.raises(UserError) as err:
        run(adapter, "train.steps=1")
    assert str(err.value) == (f"train.output_dir {adapter} is an adapter folder (adapter_config.json), not a run's "
                              f"output folder; choose another train.output_dir (the run writes adapters/, "
                              f"checkpoints/ and tb/ into it)")
    assert sorted((str(p), p.read_bytes()) for p in adapter.rglob("*") if p.is_file()) == before


@pytest.mark.parametrize("resume", [[], ["train.resume=auto"]], ids=["fresh", "resume-auto"])
def test_a_run_into_a_folder_with_an_adapter_and_no_checkpoint_is_refused(tmp_path, resume):
    """A finished run whose checkpoints/ was deleted: a new run would replace adapters/ (and the user's
    file in it) at its end; it stops before writing anything, naming the folder."""
    import shutil

    from dtrain.errors import UserError

    run(tmp_path, "train.steps=1", "train.keep_best=eval/loss", "train.eval_every=1")
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "adapters" / "NOTES.txt").write_text("mine")
    before = sorted((str(p), p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
    with pytest.raises(UserError) as err:
        run(tmp_path, "train.steps=2", *resume)
    assert str(err.value) == (f"{tmp_path} holds an earlier run's adapter (adapters/) and no checkpoint to continue "
                              f"that run from, so this run would replace it; choose another train.output_dir, or "
                              f"remove {tmp_path / 'adapters'} to train anew here")
    assert sorted((str(p), p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()) == before
    shutil.rmtree(tmp_path / "adapters")
    with pytest.raises(UserError, match=r"adapter \(adapters-last/\)"):
        run(tmp_path, "train.steps=2", *resume)
    shutil.rmtree(tmp_path / "adapters-last")
    (tmp_path / "notes.txt").write_text("an unrelated file is kept")
    again, _ = run(tmp_path, "train.steps=2", *resume)
    assert again.steps == 2 and (tmp_path / "notes.txt").read_text() == "an unrelated file is kept"


def test_a_fresh_run_writes_its_adapter_through_a_link_to_an_empty_folder(tmp_path):
    """adapters/ made beforehand as a link to an empty folder on another disk (files.atomic_folder writes
    through it): the run was refused as 'holds an earlier run's adapter (adapters/)', which held nothing."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "adapters").symlink_to(tmp_path / "disk")
    result, _ = run(tmp_path / "out", "train.steps=1")
    assert result.steps == 1 and (tmp_path / "out" / "adapters").is_symlink()
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def test_an_adapters_link_to_a_mounted_disk_s_root_is_refused_before_training(tmp_path, monkeypatch):
    """adapters/ a link to an empty disk's root (its mount point): files.atomic_folder replaces the folder it
    names by a rename, which a mount point refuses, so the run trained to its end and failed there, 'could not
    write the adapter OUT/adapters: Device or resource busy'. It is refused before the first step."""
    from dtrain.errors import UserError
    from dtrain.run.trainer import Hooks

    (tmp_path / "disk").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "adapters").symlink_to(tmp_path / "disk")
    monkeypatch.setattr("os.path.ismount", lambda p: str(p) == str(tmp_path / "disk"))
    steps = []
    with pytest.raises(UserError) as err:
        run(tmp_path / "out", "train.steps=1", hooks=Hooks(before_step=lambda step, _: steps.append(step)))
    assert str(err.value) == (
        f"{tmp_path / 'out' / 'adapters'} names {tmp_path / 'disk'}, the root of a mounted disk, which the run's "
        f"adapter cannot replace (it is written beside it and renamed into its place); link adapters to a folder "
        f"on that disk instead")
    assert steps == [] and list((tmp_path / "disk").iterdir()) == []


def test_a_run_makes_the_folder_a_dangling_checkpoints_link_names(tmp_path):
    """checkpoints/ made beforehand as a link to a folder not made yet on another disk: the run trained to its
    first save and ended there, 'could not write checkpoint OUT/checkpoints/step-0000001: File exists' (mkdir of
    the link). The folder it names is made, as for an adapters/ link."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").symlink_to(tmp_path / "disk" / "checkpoints")
    result, _ = run(tmp_path / "out", "train.steps=2", "train.save_every=1")
    assert result.steps == 2 and (tmp_path / "out" / "checkpoints").is_symlink()
    assert sorted(p.name for p in (tmp_path / "disk" / "checkpoints").iterdir()) == ["step-0000001", "step-0000002"]


def test_a_checkpoints_link_loop_is_named_as_one(tmp_path):
    """checkpoints/ a link loop (a link made to itself): the run ended at its first save in 'could not write
    checkpoint ...: File exists' (mkdir of the link), which sent the user looking for a file; the loop is named."""
    from dtrain.errors import UserError

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").symlink_to("checkpoints")
    with pytest.raises(UserError) as err:
        run(tmp_path / "out", "train.steps=2", "train.save_every=1")
    assert str(err.value) == (f"could not write checkpoint {tmp_path / 'out' / 'checkpoints' / 'step-0000001'}: Too "
                              f"many levels of symbolic links; the previous checkpoints are intact")


def test_an_output_dir_link_loop_is_named_as_one(tmp_path):
    """train.output_dir a link loop: 'output folder OUT is not writable: File exists' (mkdir of the link), where
    no file is; the loop is named."""
    from dtrain.errors import UserError

    (tmp_path / "out").symlink_to("out")
    with pytest.raises(UserError) as err:
        run(tmp_path / "out", "train.steps=1")
    assert str(err.value) == f"output folder {tmp_path / 'out'} is not writable: Too many levels of symbolic links"


def test_same_seed_same_losses_and_adapter(tmp_path):
    a, _ = run(tmp_path / "a")
    b, _ = run(tmp_path / "b")
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    wa = mx.load(str(a.adapter_dir / ADAPTER_WEIGHTS))
    wb = mx.load(str(b.adapter_dir / ADAPTER_WEIGHTS))
    assert all(mx.array_equal(wa[k], wb[k]).item() for k in wa)


def test_lora_dropout_runs_are_bitwise_repeatable(tmp_path):
    """Dropout masks come from a key per step (``step_seed``), not from MLX's global generator:
    the same seed gives the same adapter bit for bit (the global state moved in between)."""
    a, _ = run(tmp_path / "a", "lora.dropout=0.5")
    mx.random.normal((3,))  # the global generator moves between the runs
    b, _ = run(tmp_path / "b", "lora.dropout=0.5")
    c, _ = run(tmp_path / "c")  # no dropout: another loss, so the masks were really drawn
    wa, wb = (mx.load(str(r.adapter_dir / ADAPTER_WEIGHTS)) for r in (a, b))
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    assert all(mx.array_equal(wa[k], wb[k]).item() for k in wa)
    assert a.history[-1]["loss"] != c.history[-1]["loss"]  # (step 1 is equal: lora_b starts at zero)


def test_each_rank_draws_its_own_dropout_masks(monkeypatch):
    """Every rank took the step's one key, so every rank drew the same dropout masks on its own pairs
    (their noise did not average out in the all-reduce). Each rank now has a key of its own, a pure
    function of (seed, step, rank); rank 0's is the step's key as before, so one rank is unchanged."""
    from dtrain.engine import ORPO
    from dtrain.lora import DropoutKeys, KeyedDropout
    from dtrain.run import step as step_module

    class Drawn(Exception):
        pass

    pairs, keys = make_pairs(2), {}

    def record(engine, chunks, totals, with_grads, key, hyper):  # the key the step hands its micro-batches
        keys[rank] = key
        raise Drawn

    monkeypatch.setattr(step_module, "run_micro_batches", record)
    for rank in (0, 1, 0):
        step = step_module.Step(engine=SimpleNamespace(objective=ORPO(0.1)), model=None, optimizer=None,
                                sampler=SimpleNamespace(take=lambda *_: (pairs, [pairs])), pairs=pairs,
                                train=SimpleNamespace(seed=5, micro_batch_pairs=2),
                                group=SimpleNamespace(rank=rank, size=2))
        with pytest.raises(Drawn):
            step(3)
    assert mx.array_equal(keys[0], mx.random.key(step_module.step_seed(5, 3))).item()

    def mask(key):
        stream = DropoutKeys()
        stream.key = key
        return np.array(KeyedDropout(0.5, stream)(mx.ones((256,))) != 0)

    assert not np.array_equal(mask(keys[0]), mask(keys[1]))
    assert np.array_equal(mask(step_module.dropout_key(5, 3, 1)), mask(keys[1]))  # the same again: resumable


@pytest.mark.parametrize("world_size, micro_batches", [(2, 2), (3, 2), (3, 3), (4, 2)])
def test_no_rank_repeats_another_ranks_dropout_masks(world_size, micro_batches):
    """Rank r's key was ``split(step key, r + 1)[r]``, which is rank 0's key for micro-batch r when rank 0
    splits the step key into r + 1 micro-batches (``run_micro_batches``); with 2 micro-batches rank r's
    own split then equals that micro-batch's dropout stream, so rank 1 drew rank 0's masks shifted by
    one module. Every mask a step draws on one rank must differ from every mask of another."""
    from dtrain.engine import ORPO, StepResult, run_micro_batches
    from dtrain.lora import DropoutKeys, KeyedDropout
    from dtrain.run.step import dropout_key

    class Drawing:  # an engine whose micro-batch draws 4 masks from the key it is given, as LoRA dropout does
        objective = ORPO(0.1)

        def __init__(self):
            self.masks = []

        def step(self, chunk, totals, key=None, hyper=None):
            stream = DropoutKeys()
            stream.key = key
            dropout = KeyedDropout(0.5, stream)
            self.masks += [np.packbits(np.array(dropout(mx.ones((256,))) != 0)).tobytes() for _ in range(4)]
            return StepResult(mx.zeros(()), {}, {})

    drawn = []
    for rank in range(world_size):
        engine = Drawing()
        run_micro_batches(engine, [[rank]] * micro_batches, None, True, dropout_key(5, 3, rank))
        drawn.append(set(engine.masks))
    for a in range(world_size):
        for b in range(a + 1, world_size):
            assert not drawn[a] & drawn[b], (a, b, len(drawn[a] & drawn[b]))


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """Micro-batches are weighted by their real token and pair counts: the
    summed gradient of 1-pair micro-batches equals the 4-pair batch's."""
    from dtrain.config import LoraConfig
    from dtrain.engine import ReferenceEngine, run_micro_batches
    from dtrain.lora import apply_lora
    from dtrain.engine import ORPO, batch_totals

    model = make_tiny_model()
    apply_lora(model, LoraConfig(rank=2))
    model.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), model.trainable_parameters()))
    engine = ReferenceEngine(model, ORPO(0.1))
    pairs = make_pairs(4)
    norm = batch_totals(pairs, "full")
    whole, g_whole = run_micro_batches(engine, [pairs], norm, with_grads=True)
    parts, g_parts = run_micro_batches(engine, [[p] for p in pairs], norm, with_grads=True)
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


def test_global_batch_larger_than_the_training_pairs_is_refused(tmp_path):
    from dtrain.errors import UserError

    with pytest.raises(UserError) as err:
        run(tmp_path, "train.global_batch_pairs=8", n_train=1)
    assert str(err.value) == ("train.global_batch_pairs is 8 but the demo data has 1 training pair(s) (after the "
                              "held-out split, data.valid_fraction=0.1); a step would train a pair more than once: "
                              "set train.global_batch_pairs to at most 1, or add data")
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []  # refused before the output folder


def test_output_folder_in_use_is_refused_and_left_alone(tmp_path):
    import os
    import socket

    from dtrain.run.output import OutputLock
    from dtrain.errors import UserError

    tmp_path.mkdir(exist_ok=True)
    holder = OutputLock(tmp_path)  # another run holding the folder (flock: exclusive even within one process)
    with pytest.raises(UserError) as err:
        run(tmp_path)
    assert str(err.value) == (f"output folder {tmp_path} is in use by another dtrain run (pid {os.getpid()} on "
                              f"{socket.gethostname()}); wait for it to end, or choose another train.output_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dtrain.lock"]  # nothing written
    holder.release()
    result, _ = run(tmp_path, "train.steps=1")
    assert result.steps == 1 and result.adapter_dir.is_dir()


def test_a_refused_start_leaves_no_new_output_folder(tmp_path):
    """A resume the checkpoint refuses (another learning rate) into a new train.output_dir left new/deep/ made,
    holding the run's .dtrain.lock; so did a folder without room for the run. The folders it made go again; a
    folder that was there keeps what it held."""
    from dtrain.errors import UserError
    from dtrain.run import output

    run(tmp_path / "a", "train.steps=2")
    for out in (tmp_path / "new" / "deep", tmp_path / "a"):
        with pytest.raises(UserError, match="was made with different settings: train.learning_rate"):
            run(out, "train.steps=4", f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step-0000002'}",
                "train.learning_rate=0.02")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".dtrain.lock", "adapters", "checkpoints", "tb"]
    with pytest.raises(UserError, match="MB free"):
        output.prepare_output(tmp_path / "new" / "deep", output.DiskPlan(10**18, 1, 0, 1), False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_adapter_config_names_the_base_model_in_adapter_and_checkpoint(tmp_path):
    import json

    result, _ = run(tmp_path, "train.steps=2")
    final = json.loads((result.adapter_dir / ADAPTER_CONFIG).read_text())
    assert final == {"fine_tune_type": "lora", "num_layers": 4,
                     "lora_parameters": {"rank": 2, "scale": 20.0, "dropout": 0.0},
                     "base_model": {"path": "tiny-llama", "source": "tiny-llama"}}
    saved = json.loads((tmp_path / "checkpoints" / "step-0000002" / ADAPTER_CONFIG).read_text())
    assert saved == final  # one writer (lora.write_adapter) for both


def test_gguf_base_model_reference_is_path_and_sha256(demo_path):
    from dtrain.models import demo, load_model

    loaded = load_model(str(demo_path))
    assert loaded.reference == {"path": str(demo_path.resolve()), "sha256": demo.SHA256}


def test_hparams_are_recorded_in_the_run_itself(tmp_path):
    from dtrain.run.tracking import read_events

    result, _ = run(tmp_path)
    assert [p.name for p in (tmp_path / "tb").iterdir()] == [result.run_dir.name]
    assert [p for p in result.run_dir.iterdir() if p.is_dir()] == []  # no <run>/hparams second run
    tags = {v.tag: e.step for e in read_events(result.run_dir) for v in e.summary.value}
    assert {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"} <= tags.keys()
    scalars = read_scalars(result.run_dir)
    assert scalars["hparam/loss"] == [(4, pytest.approx(result.history[-1]["loss"], rel=1e-6))]
    assert scalars["hparam/eval/loss"] == [(4, pytest.approx(result.evals[4]["eval/loss"], rel=1e-6))]




@pytest.mark.parametrize("override, changed", [
    ("train.seed=1", "train.seed: 0 in the checkpoint, 1 now"),
    ("data.valid_fraction=0.2", "data.valid_fraction: 0.1 in the checkpoint, 0.2 now"),
    ("data.demo_seed=3", "data.demo_seed: 0 in the checkpoint, 3 now"),
    ("data.max_prompt_length=64", "data.max_prompt_length: 512 in the checkpoint, 64 now"),
    ("train.global_batch_pairs=3", "train.global_batch_pairs: 4 in the checkpoint, 3 now"),
    ("lora.rank=4", "lora.rank: 2 in the checkpoint, 4 now"),
])
def test_resume_refuses_a_change_of_what_each_step_trains(tmp_path, override, changed):
    from dtrain.errors import UserError

    run(tmp_path, "train.steps=2")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError) as err:
        run(tmp_path, "train.steps=4", "train.resume=auto", override)
    assert str(err.value) == (f"resume: {tmp_path}/checkpoints/step-0000002 was made with different settings: "
                              f"{changed}. {RESUME_HINT}")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_resume_refuses_other_training_pairs(tmp_path):
    from dtrain.run.checkpoint import pairs_sha256
    from dtrain.errors import UserError

    run(tmp_path, "train.steps=2")
    was, now = make_pairs(12), make_pairs(12, seed=1)
    with pytest.raises(UserError) as err:
        run(tmp_path, "train.steps=4", "train.resume=auto", data_seed=1)
    assert str(err.value) == (f"resume: {tmp_path}/checkpoints/step-0000002 was made with different settings: "
                              f"training pairs sha256: {pairs_sha256(was[:9])!r} in the checkpoint, "
                              f"{pairs_sha256(now[:9])!r} now; held-out pairs sha256: {pairs_sha256(was[9:])!r} in "
                              f"the checkpoint, {pairs_sha256(now[9:])!r} now. {RESUME_HINT}")


def test_a_resumed_run_without_held_out_pairs_saves_its_last_step(tmp_path):
    """Steps 3-4 trained after a resume from step 2 end with checkpoint 4 and the HPARAMS record at step 4, as
    an uninterrupted run's end (it read "no held-out pairs" as "already finished" and saved neither)."""
    first, _ = run(tmp_path, "train.steps=2", n_valid=0)
    resumed, _ = run(tmp_path, "train.resume=auto", n_valid=0)
    assert len(resumed.history) == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]
    assert read_scalars(resumed.run_dir)["hparam/loss"] == [(2, pytest.approx(first.history[-1]["loss"], rel=1e-6)),
                                                            (4, pytest.approx(resumed.history[-1]["loss"], rel=1e-6))]


def test_a_run_without_held_out_pairs_stopped_in_its_last_step_keeps_its_hparams_record(tmp_path):
    """A signal in step 4 of 4 saves checkpoint 4, which its resume takes for a finished run (it trains and
    saves nothing): the HPARAMS record of the run's end was never written. It is written with that save."""
    from dtrain.run.trainer import Hooks

    def stop_in_4(step, run_):
        if step == 4:
            run_.stop.requested = True

    whole, _ = run(tmp_path / "whole", n_valid=0)
    cut, _ = run(tmp_path / "cut", n_valid=0, hooks=Hooks(before_step=stop_in_4))
    assert cut.stopped and cut.steps == 4
    resumed, _ = run(tmp_path / "cut", "train.resume=auto", n_valid=0)
    assert resumed.history == [] and (resumed.adapter_dir / ADAPTER_WEIGHTS).read_bytes() == (
        whole.adapter_dir / ADAPTER_WEIGHTS).read_bytes()
    assert read_scalars(cut.run_dir)["hparam/loss"] == read_scalars(whole.run_dir)["hparam/loss"] == [
        (4, pytest.approx(whole.history[-1]["loss"], rel=1e-6))]


def test_resumed_run_reports_the_evaluations_of_the_whole_run(tmp_path):
    args = ("train.schedule=constant", "train.save_every=2")
    whole, _ = run(tmp_path / "whole", *args)
    run(tmp_path / "cut", *args, "train.steps=2")
    resumed, _ = run(tmp_path / "cut", *args, "train.resume=auto")
    assert len(resumed.history) == 2 and sorted(resumed.evals) == [0, 2, 4]
    assert resumed.evals == whole.evals  # bitwise: step 0 and 2 from the checkpoint, 4 computed
    acc = "eval/rewards/accuracies"
    assert resumed.summary() == (f"eval reward accuracy (chosen preferred over rejected): step 0 "
                                 f"{whole.evals[0][acc]:.3f} -> step 4 {whole.evals[4][acc]:.3f}")


def test_an_sft_run_counts_rows_not_pairs(tmp_path, capsys):
    """objective.kind sft trains rows with one completion: its run said "9 train / 3 valid pairs", "3 held-out
    pairs" and "forward+backward of 4 pairs", and its eval bar counted pairs."""
    run(tmp_path, "objective.kind=sft", "train.progress=true", "train.steps=2", "train.eval_every=0")
    err = capsys.readouterr().err
    assert "model tiny-llama; 9 train / 3 valid rows; " in err
    assert "eval at step 0: 3 held-out rows" in err
    assert "step 1: forward+backward of 4 rows (<= 4 on each of 1 rank(s), micro-batches of 4)" in err
    assert "row/s" in err or "s/row" in err  # the eval bar's unit
    assert "pair" not in err


def test_the_start_line_counts_the_held_out_pairs_eval_pairs_leaves_out(tmp_path, capsys):
    """train.eval_pairs 2 of 3 held-out pairs: the start line said '2 valid pairs', as if 2 were held out."""
    run(tmp_path, "train.eval_pairs=2", "train.steps=1", "train.eval_every=0")
    assert "model tiny-llama; 9 train / 2 of 3 valid pairs; " in capsys.readouterr().err


def test_progress_shows_evaluation_apart_and_the_first_step(tmp_path, capsys):
    run(tmp_path, "train.progress=true", "train.steps=2", "train.eval_every=0")
    err = capsys.readouterr().err
    assert "eval at step 0: 3 held-out pairs" in err
    assert "step 1: forward+backward of 4 pairs (<= 4 on each of 1 rank(s), micro-batches of 4)" in err
    assert " s/step, loss " in err and "step/s" not in err  # no tqdm rate: it would count evaluations in
    assert ": :" not in err and "train: " in err  # tqdm's description ends ": " already (it read "train: :")


def test_step_rate_counts_optimizer_steps_only(tmp_path):
    from dtrain.run.tracking import RunLogger

    log = RunLogger(tmp_path, total_steps=3, progress=True)
    log.progress(1, {"perf/step_seconds": 2.0, "loss": 1.0})
    bar = log.eval_bar(1, 5)
    bar.update(5)
    bar.close()
    log.progress(2, {"perf/step_seconds": 4.0, "loss": 1.0})
    assert log.step_rate() == 3.0 and log.bar.postfix == "3.00 s/step, loss 1.0000"
    log.close()


# What MLX 0.32 raises when a device allocation fails, as seen on an H100 (CUDA) and reported for Metal
OOM_ERRORS = [
    "cudaGraphInstantiate(&handle_, graph, nullptr, nullptr, 0) failed: out of memory",
    "[METAL] Command buffer execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
    "[metal::malloc] Attempting to allocate 28611722496 bytes which is greater than the maximum allowed buffer size "
    "of 9534832640 bytes.",
    "[malloc] Unable to allocate 68719476736 bytes.",
]


@pytest.mark.parametrize("text", OOM_ERRORS)
def test_out_of_memory_is_one_message_and_the_checkpoints_stay(tmp_path, text):
    from dtrain.errors import UserError
    from dtrain.run import checkpoint as ckpt
    from dtrain.run.trainer import Hooks

    def before_step(step, run_):
        if step == 3:
            raise RuntimeError(text)

    with pytest.raises(UserError) as err:
        run(tmp_path, "train.save_every=2", "engine.memory_budget_gb=3.5", hooks=Hooks(before_step=before_step))
    message = str(err.value)
    assert message.startswith(f"out of memory after step 2 of 4 ({text.splitlines()[0]}; peak ")
    assert "engine.memory_budget_gb 3.5 is more than this device gives the run" in message
    assert "--train.resume auto continues from the latest" in message and "\n" not in message
    saved = ckpt.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in saved] == [ckpt.checkpoint_dir(tmp_path / "checkpoints", 2).name]
    assert ckpt.validate(saved[0]) is None  # complete: a resume can take it


def test_metals_live_buffer_limit_is_one_message_that_does_not_blame_the_budget(tmp_path):
    """MLX's Metal allocator also refuses an allocation when the count of live buffers reaches macOS's
    resource limit (iogpu.rsrc_limit, mlx PR 1718), whatever their size: that ended the run in a traceback.
    It is one line now, which says it is a count and not the memory budget, and where the checkpoints are."""
    from dtrain.errors import UserError
    from dtrain.run import checkpoint as ckpt
    from dtrain.run.trainer import Hooks

    def before_step(step, run_):
        if step == 3:
            raise RuntimeError("[metal::malloc] Resource limit (499000) exceeded.")

    with pytest.raises(UserError) as err:
        run(tmp_path, "train.save_every=2", hooks=Hooks(before_step=before_step))
    assert str(err.value) == (
        "Metal's limit on live buffers reached after step 2 of 4 ([metal::malloc] Resource limit (499000) exceeded.): "
        "MLX held more arrays at once than macOS allows a process (iogpu.rsrc_limit), a count, not the memory "
        "budget; checkpoints already written are intact and --train.resume auto continues from the latest")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-0000002"]


def test_other_runtime_errors_are_not_reported_as_out_of_memory(tmp_path):
    from dtrain.run.trainer import Hooks

    def before_step(step, run_):
        raise RuntimeError("[matmul] Last dimension of first input with shape (2,3) must match second-to-last")

    with pytest.raises(RuntimeError, match=r"^\[matmul\] Last dimension"):
        run(tmp_path, hooks=Hooks(before_step=before_step))


def test_out_of_memory_in_setup_names_setup(tmp_path, monkeypatch):
    from dtrain.errors import UserError
    from dtrain.run import trainer

    def setup(*args):
        raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")

    monkeypatch.setattr(trainer, "setup", setup)
    with pytest.raises(UserError, match=r"^out of memory while setting up the run \(cudaMallocAsync"):
        run(tmp_path)


def test_out_of_memory_under_the_default_budget_names_the_device_budget(tmp_path):
    from dtrain.errors import UserError
    from dtrain.memory import GIB, run_budget_bytes
    from dtrain.run.trainer import Hooks

    def before_step(step, run_):
        raise RuntimeError("[malloc] Unable to allocate 68719476736 bytes.")

    with pytest.raises(UserError) as err:
        run(tmp_path, hooks=Hooks(before_step=before_step))
    assert f"the default memory budget ({run_budget_bytes(0) / GIB:.1f} GiB on this cpu device) is more" in str(err.value)


def test_a_warmup_as_long_as_the_run_gets_a_notice(tmp_path, capsys):
    """train.warmup_steps >= train.steps (the default 10 in a short run): the rate never reached its peak nor
    decayed, unsaid. The notice gives the peak it reaches; a warmup shorter than the run gets none."""
    from dtrain.run.optimizer import learning_rate

    lines = {}
    for name, warmup in (("long", 10), ("equal", 4), ("short", 3)):
        run(tmp_path / name, f"train.warmup_steps={warmup}")
        lines[name] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train.warmup_steps")]
    cfg = load_config(None, ["data.demo_pairs=1", "train.steps=4", "train.warmup_steps=10",
                             "train.learning_rate=1e-2"]).train
    assert learning_rate(4, cfg) == pytest.approx(1e-2 * 4 / 10)  # the peak the notice names
    assert lines == {
        "long": ["train.warmup_steps 10 >= train.steps 4: the learning rate warms up for the whole run, peaks at "
                 "4/10 of train.learning_rate and never decays; set train.warmup_steps below train.steps"],
        "equal": ["train.warmup_steps 4 >= train.steps 4: the learning rate warms up for the whole run, reaches "
                  "train.learning_rate only at the last step and never decays; set train.warmup_steps below "
                  "train.steps"],
        "short": []}


def test_a_key_the_run_does_not_read_gets_a_notice(tmp_path, capsys):
    """engine.segment_layers under the default engine.kind auto was ignored without a word."""
    run(tmp_path, "train.steps=1", "engine.segment_layers=1")
    assert [x for x in capsys.readouterr().err.splitlines() if x.startswith("'engine.")] == [
        "'engine.segment_layers' is 1 but engine.kind auto (it sizes the ranges itself) does not read it: it has "
        "no effect"]


def test_a_run_without_held_out_pairs_stopped_by_skipped_steps_in_its_last_step_keeps_its_hparams_record(tmp_path):
    """train.max_skipped_steps stopping step 3 of 3 saves checkpoint 3, which its resume takes for a finished run
    (it trains, saves and records nothing): the HPARAMS record of the run's end was never written, as for a
    signal in the last step. It is written with that save."""
    from dtrain.errors import UserError

    # step 1 trains, steps 2 and 3 are non-finite (at 1e38, step 1's update was inf: skipped too)
    blow_up = ("train.steps=3", "train.max_skipped_steps=2", "train.learning_rate=1e37", "train.grad_clip=0",
               "train.warmup_steps=0")
    with pytest.raises(UserError, match="step 3: 2 steps in a row had a non-finite loss"):
        run(tmp_path, *blow_up, n_valid=0)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "step-0000003"
    resumed, _ = run(tmp_path, "train.resume=auto", *blow_up, n_valid=0)
    assert resumed.history == [] and resumed.steps == 3
    assert [s for s, _ in read_scalars(resumed.run_dir)["hparam/loss"]] == [3]


def test_an_update_that_overflows_float32_is_skipped_and_named_and_the_adapter_stays_finite(tmp_path, capsys):
    """train.learning_rate 1e38 (finite in float32; AdamW's bias correction divides it by 1 - 0.9 at step 1):
    step 1's loss and gradient were finite, its update made the LoRA weights inf/NaN, the later steps were
    skipped as non-finite, and adapters/ was written with the NaN."""
    from dtrain.errors import UserError

    result, _ = run(tmp_path, "train.learning_rate=1e38", "train.warmup_steps=0", "train.schedule=constant",
                    "train.steps=2")
    with pytest.raises(UserError, match=r"^step 2: 2 steps in a row had non-finite LoRA weights after the update "
                                        r"\(learning rate 1e\+38\) \(last batch: gen:"):
        run(tmp_path / "again", "train.learning_rate=1e38", "train.warmup_steps=0", "train.schedule=constant",
            "train.max_skipped_steps=2")
    err = capsys.readouterr().err
    for step in (1, 2):
        assert f"step {step}: non-finite LoRA weights after the update (learning rate 1e+38), update skipped" in err
    assert result.skipped_steps == 2 and all(np.isfinite(h["loss"]) for h in result.history)
    weights = mx.load(str(result.adapter_dir / "adapters.safetensors"))
    assert all(bool(mx.isfinite(w).all()) for w in weights.values())


def test_a_step_with_a_zero_gradient_is_named(tmp_path, capsys):
    """A step whose gradient is zero everywhere (a saturated loss: SimPO with objective.beta 1e6 gave loss 0 and
    grad_norm 0 at step 1; DPO with beta 1e-30 on every step) was logged and counted as trained without a word."""
    from dtrain.engine.common import StepResult
    from dtrain.run.trainer import Hooks

    class Flat:  # the engine, its gradients zero at step 2
        def __init__(self, engine):
            self.engine, self.name, self.objective, self.calls = engine, engine.name, engine.objective, 0

        def step(self, chunk, totals, key=None, hyper=None):
            out = self.engine.step(chunk, totals, key, hyper)
            self.calls += 1
            return StepResult(out.loss, out.sums, tree_map(mx.zeros_like, out.grads)) if self.calls == 2 else out

        def evaluate(self, chunk, totals, key=None, hyper=None):
            return self.engine.evaluate(chunk, totals, key, hyper)

    result, _ = run(tmp_path, "train.steps=3", hooks=Hooks(engine=Flat))
    err = capsys.readouterr().err
    assert [h["grad_norm"] == 0.0 for h in result.history] == [False, True, False]
    assert ("step 2: zero gradient: the loss gives this batch no learning signal (flat or saturated for every "
            "pair: check the objective's hyper-parameters and the learning rate); the update is AdamW's momentum "
            "alone\n") in err, err
    assert "step 1: zero" not in err and "step 3: zero" not in err and result.skipped_steps == 0


def test_progress_false_draws_no_tokenizing_bar(tmp_path, monkeypatch):
    """train.progress false still drew a first run's 'tokenizing train' bar (load_dataset showed one whenever it
    logged), on output meant to have none; the step and DPO reference bars follow the key, and so does it."""
    import tqdm

    from conftest import make_tokenizer

    bars = []

    class Recorded(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            bars.append((kwargs.get("desc"), kwargs.get("disable", False)))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    for progress in ("false", "true"):
        bars.clear()
        cfg = load_config(None, [f"train.output_dir={tmp_path / progress}", "data.demo_pairs=12", "train.steps=1",
                                 "train.global_batch_pairs=2", "train.micro_batch_pairs=2", "lora.rank=2",
                                 "train.eval_pairs=1", f"train.progress={progress}"])
        loaded = SimpleNamespace(aliases=(), model=make_tiny_model(), tokenizer=make_tokenizer(), identity="tiny",
                                 source="tiny-llama", reference={"path": "tiny-llama"})
        train(cfg, loaded=loaded)
        off = progress == "false"
        assert [bar for bar in bars if (bar[0] or "").startswith("tokenizing")] == [("tokenizing train", off),
                                                                                   ("tokenizing valid", off)]


@pytest.mark.parametrize("where", ["RunLogger.close", "OutputLock.release"])
def test_a_stop_signal_while_a_finished_run_closes_its_log_or_lock_changes_nothing(tmp_path, monkeypatch, where):
    """A stop that came after the last step, while the run closed its event file or released its
    output folder, found the handlers already restored: a KeyboardInterrupt out of ``train`` (the rank
    exited 130 and ``./launch`` said the work after the last step was lost). The stop handlers stay in
    place until the run's clean-up is done: the finished run returns its result."""
    import os
    import signal

    from dtrain.run import output, tracking

    cls, name = where.split(".")
    owner = {"RunLogger": tracking.RunLogger, "OutputLock": output.OutputLock}[cls]
    original, sent = getattr(owner, name), []

    def stopping(self, *args, **kwargs):
        sent.append(where)
        os.kill(os.getpid(), signal.SIGINT)  # handled before the next bytecode: a stop in the clean-up
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, stopping)
    before = signal.getsignal(signal.SIGINT)
    result, _ = run(tmp_path)
    assert sent == [where]
    assert not result.stopped and (tmp_path / "adapters" / ADAPTER_WEIGHTS).is_file()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_run_cut_after_a_checkpoint_and_resumed_to_end_there_writes_its_end_record(tmp_path):
    """Planned for 10 steps, killed in step 7 after checkpoint 6, resumed with train.steps=6: checkpoint 6 was
    taken for a finished run's last one, and the run ended without the HPARAMS record and keep_best's `best`
    text that an uninterrupted 6-step run writes. Its checkpoint now says it did not close its run."""
    import json

    from dtrain.run.tracking import read_events
    from dtrain.run.trainer import Hooks

    class Crash(Exception):
        pass

    def crash_in_7(step, run_):
        if step == 7:
            raise Crash

    def end_records(run_dir):
        events = [(e.step, v) for e in read_events(run_dir) for v in e.summary.value]
        return ([s for s, v in events if v.tag == "_hparams_/experiment"],
                [(s, v.tensor.string_val[0].decode()) for s, v in events if v.tag == "best/text_summary"])

    args = ("train.save_every=3", "train.eval_every=3", "train.keep_best=eval/loss")
    whole, _ = run(tmp_path / "whole", *args, "train.steps=6")
    with pytest.raises(Crash):
        run(tmp_path / "cut", *args, "train.steps=10", hooks=Hooks(before_step=crash_in_7))
    state = tmp_path / "cut" / "checkpoints" / "step-0000006" / "state.json"
    assert json.loads(state.read_text())["closed"] is False
    resumed, _ = run(tmp_path / "cut", *args, "train.steps=6", "train.resume=auto")
    assert resumed.history == [] and resumed.best.step is not None
    kept = f"adapters/ holds step {resumed.best.step} (eval/loss {resumed.best.value:#.4g})"
    assert end_records(resumed.run_dir) == ([6], [(6, kept)])
    assert end_records(whole.run_dir) == ([6], [(6, f"adapters/ holds step {whole.best.step} "
                                                   f"(eval/loss {whole.best.value:#.4g})")])
    assert read_scalars(resumed.run_dir)["hparam/eval/loss"] == [(6, pytest.approx(resumed.evals[6]["eval/loss"]))]
    assert json.loads(state.read_text())["closed"] is True
    again, _ = run(tmp_path / "cut", *args, "train.steps=6", "train.resume=auto")  # now finished: nothing again
    assert again.history == [] and end_records(again.run_dir) == ([6], [(6, kept)])


def test_the_first_step_line_names_the_micro_batch_a_rank_runs():
    """8 pairs on 2 ranks with train.micro_batch_pairs 8 (./launch -n 2 configs/demo.yaml): each rank runs
    one micro-batch of 4, but the line said "micro-batches of 8" (the key, not what is run)."""
    from dtrain.run.trainer import first_step_text
    cfg = load_config(None, ["train.global_batch_pairs=8", "train.micro_batch_pairs=8"], need_data=False)
    run_ = SimpleNamespace(cfg=cfg, group=SimpleNamespace(size=2), state=SimpleNamespace(step=0))
    assert first_step_text(run_) == "step 1: forward+backward of 8 pairs (<= 4 on each of 2 rank(s), micro-batches of 4)"
    cfg = load_config(None, ["train.global_batch_pairs=8", "train.micro_batch_pairs=3"], need_data=False)
    run_ = SimpleNamespace(cfg=cfg, group=SimpleNamespace(size=2), state=SimpleNamespace(step=0))
    assert first_step_text(run_) == "step 1: forward+backward of 8 pairs (<= 4 on each of 2 rank(s), micro-batches of 3)"
