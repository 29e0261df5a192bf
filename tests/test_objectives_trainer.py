"""Objectives in the training loop: DPO's reference pass (once per pair per run,
cached, none after a resume, equal to a fresh computation), DPO's first loss
ln 2, and exact resume for every objective."""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from conftest import make_pairs, make_tiny_model
from dtrain.config import load_config
from dtrain.engine import ReferenceEngine, batch_totals
from dtrain.run.reference import ReferenceLogps
from dtrain.run.tracking import read_scalars
from dtrain.run.trainer import Hooks, train

N_TRAIN, N_VALID = 9, 3


class Counting:
    """Wraps an engine; records the sources of the pairs each evaluate() runs."""

    def __init__(self, engine, seen):
        self.engine, self.name, self.objective, self.seen = engine, engine.name, engine.objective, seen

    def evaluate(self, chunk, totals, key=None, hyper=None):
        self.seen.extend(p.source for p in chunk)
        return self.engine.evaluate(chunk, totals, key, hyper)

    def step(self, chunk, totals, key=None, hyper=None):
        return self.engine.step(chunk, totals, key, hyper)


def config(out, kind, *overrides):
    return load_config(None, [
        f"train.output_dir={out}", "data.demo_pairs=1", "train.steps=4", "train.global_batch_pairs=4",
        "train.micro_batch_pairs=2", "train.learning_rate=1e-2", "train.schedule=constant", "train.warmup_steps=0",
        "lora.rank=2", "train.progress=false", "train.eval_every=2", f"objective.kind={kind}", *overrides])


def run(out, kind, *overrides, hooks=Hooks()):
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=None, identity="tiny", source="tiny-llama",
                             reference={"path": "tiny-llama"})
    pairs = make_pairs(N_TRAIN + N_VALID, seed=0)
    dataset = SimpleNamespace(train=pairs[:N_TRAIN], valid=pairs[N_TRAIN:], fingerprint="fp")
    return train(config(out, kind, *overrides), loaded=loaded, dataset=dataset, hooks=hooks)


def counting_hooks(seen, **kw):
    return Hooks(reference_engine=lambda engine: Counting(engine, seen), **kw)


def adapter(result) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(Path(result.adapter_dir) / "adapters.safetensors")).items()}


def test_non_finite_reference_log_probs_are_refused_naming_the_pairs(tmp_path):
    """The step-0 model gave two pairs a NaN reference log-prob (a float16 overflow, say): every step that drew
    one had a NaN loss and was skipped as non-finite, its other pairs with it, the pairs themselves never named."""
    from dtrain.engine.common import StepResult
    from dtrain.errors import UserError

    class Poisoned(Counting):  # NaN for the first micro-batch of the train pairs
        def evaluate(self, chunk, totals, key=None, hyper=None):
            out = self.engine.evaluate(chunk, totals, key, hyper)
            if chunk[0].source == "gen:0":
                out = StepResult(out.loss, {**out.sums, "ref_chosen": out.sums["ref_chosen"] * mx.nan}, out.grads)
            return out

    with pytest.raises(UserError) as err:
        run(tmp_path, "dpo", hooks=Hooks(reference_engine=lambda engine: Poisoned(engine, [])))
    assert str(err.value) == (
        "DPO reference log-probs (the model at step 0) are NaN or inf for 2 train pair(s): gen:0, gen:1; every step "
        "that drew one would be skipped as non-finite: check model.dtype (float16 overflows) or remove these pairs")
    assert not (tmp_path / "adapters").exists() and not (tmp_path / "checkpoints").exists()


def test_dpo_reference_pass_once_per_pair_then_from_the_cache(tmp_path):
    seen = []
    first = run(tmp_path / "a", "dpo", hooks=counting_hooks(seen))
    sources = [p.source for p in make_pairs(N_TRAIN + N_VALID, seed=0)]
    assert sorted(seen) == sorted(sources)  # every train and valid pair once
    # the cached values equal a fresh computation, pair by pair, on the step-0 model
    cache = tmp_path / "a" / "data_cache"
    cached = np.concatenate([np.load(next(cache.glob(f"reference-*-{part}.npz")))["values"] for part in ("train", "valid")])
    model = make_tiny_model(seed=0)
    from dtrain.config import LoraConfig
    from dtrain.lora import apply_lora

    apply_lora(model, LoraConfig(rank=2))
    model.eval()
    engine = ReferenceEngine(model, ReferenceLogps())
    for i, p in enumerate(make_pairs(N_TRAIN + N_VALID, seed=0)):
        sums = engine.evaluate([p], batch_totals([p], "response")).sums
        np.testing.assert_allclose(cached[i], [sums["ref_chosen"].item(), sums["ref_rejected"].item()], rtol=1e-5)
    # step 1: policy = reference, so the DPO loss is ln 2 per pair; rewards start at 0
    assert first.history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first.evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)
    # the held-out pairs are cut into the reference pass's micro-batches: the policy's log-probs at step 0
    # are the reference's bit for bit, so no pair is counted as preferred (TRL: 0 at step 0)
    assert first.evals[0]["eval/rewards/margins"] == 0.0
    assert first.evals[0]["eval/rewards/accuracies"] == 0.0
    assert first.history[-1]["loss"] < math.log(2)  # it trains
    # resumed after step 2 (interrupted at step 3): no reference forward, the same adapter as uninterrupted
    seen.clear()

    def crash(step, run_):
        if step == 3:
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        run(tmp_path / "b", "dpo", "train.save_every=2", hooks=counting_hooks(seen, before_step=crash))
    assert len(seen) == N_TRAIN + N_VALID
    seen.clear()
    resumed = run(tmp_path / "b", "dpo", "train.save_every=2", "train.resume=auto", hooks=counting_hooks(seen))
    assert seen == []
    whole, again = adapter(first), adapter(resumed)
    assert all(np.array_equal(whole[k], again[k]) for k in whole)
    for a, b in zip(first.history[2:], resumed.history):
        assert a["loss"] == b["loss"]


def test_dpo_step_1_prefers_no_training_pair(tmp_path):
    """At step 1 the policy is the reference, so every reward is 0 and no pair is preferred (TRL: accuracy 0).
    The step packs its 4-pair micro-batches unlike the reference pass, so one pair's chosen sum came out one
    float32 ulp above its reference: rewards/accuracies 1/6, from rounding alone."""
    from dtrain.types import TokenizedPair

    rng = np.random.default_rng(1)
    pairs = [TokenizedPair([1, *rng.integers(5, 512, int(rng.integers(2, 60))).tolist()],
                           [*rng.integers(5, 512, int(rng.integers(1, 60))).tolist(), 2],
                           [*rng.integers(5, 512, int(rng.integers(1, 60))).tolist(), 2], f"gen:{i}") for i in range(6)]
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=1, hidden_size=128, intermediate_size=256,
                                                               num_hidden_layers=2),
                             tokenizer=None, identity="tiny", source="tiny-llama", reference={"path": "tiny-llama"})
    cfg = config(tmp_path, "dpo", "train.steps=1", "train.global_batch_pairs=6", "train.micro_batch_pairs=4")
    first = train(cfg, loaded=loaded, dataset=SimpleNamespace(train=pairs, valid=[], fingerprint="fp")).history[0]
    assert first["rewards/accuracies"] == 0.0
    assert abs(first["rewards/margins"]) < 1e-6 and first["loss"] == pytest.approx(math.log(2), abs=1e-6)


class Chunks:
    """Wraps an engine; records the sources of each micro-batch evaluate() runs."""

    def __init__(self, engine, chunks):
        self.engine, self.name, self.objective, self.chunks = engine, engine.name, engine.objective, chunks

    def evaluate(self, chunk, totals, key=None, hyper=None):
        self.chunks.append(tuple(p.source for p in chunk))
        return self.engine.evaluate(chunk, totals, key, hyper)

    def step(self, chunk, totals, key=None, hyper=None):
        return self.engine.step(chunk, totals, key, hyper)


def test_evaluation_cuts_the_held_out_pairs_as_the_reference_pass_does(tmp_path):
    # the same micro-batches give the same rounding: at step 0 the policy's log-probs are the reference's
    # bit for bit and no held-out pair counts as preferred (N_TRAIN = 9 and micro 2 put a train and a valid
    # pair in one micro-batch if the valid pairs were cut after the train pairs)
    ref, ev = [], []
    run(tmp_path, "dpo", hooks=Hooks(reference_engine=lambda e: Chunks(e, ref), engine=lambda e: Chunks(e, ev)))
    valid = {p.source for p in make_pairs(N_TRAIN + N_VALID, seed=0)[N_TRAIN:]}
    held_out = [c for c in ev if set(c) <= valid]
    assert held_out and len(held_out) == len(ev)  # the training engine evaluates only held-out pairs here
    assert set(held_out) <= set(ref)


def test_the_reference_pass_cuts_the_held_out_pairs_train_eval_pairs_keeps(tmp_path):
    """With train.eval_pairs the reference pass cut every held-out pair while evaluation cuts only the
    first eval_pairs: the last evaluated micro-batch was not one the reference pass ran (here (v0,)
    against (v0, v1)), so its step-0 rewards were rounding noise, not 0; and it computed pairs no
    evaluation reads."""
    ref, ev = [], []
    result = run(tmp_path, "dpo", "train.eval_pairs=1",
                 hooks=Hooks(reference_engine=lambda e: Chunks(e, ref), engine=lambda e: Chunks(e, ev)))
    assert result.evals[0]["eval/rewards/rejected"] == 0.0 and result.evals[0]["eval/rewards/margins"] == 0.0
    first = make_pairs(N_TRAIN + N_VALID, seed=0)[N_TRAIN].source
    assert ev and set(ev) == {(first,)}
    assert set(ev) <= set(ref)
    assert not {p.source for p in make_pairs(N_TRAIN + N_VALID, seed=0)[N_TRAIN + 1:]} & {s for c in ref for s in c}


def test_reference_cache_key_covers_the_model_and_the_pairs():
    from dtrain.run.reference import cache_key

    pairs = make_pairs(4, seed=0)
    base = cache_key("tiny", None, pairs)
    assert cache_key("tiny", None, list(pairs)) == base
    assert cache_key("other", None, pairs) != base
    assert cache_key("tiny", "abc", pairs) != base
    assert cache_key("tiny", None, pairs[:3]) != base
    changed = [pairs[0].__class__(pairs[0].prompt, pairs[0].chosen + [7], pairs[0].rejected)] + pairs[1:]
    assert cache_key("tiny", None, changed) != base


@pytest.mark.parametrize("kind", ["simpo", "sft"])
def test_resume_equals_uninterrupted(tmp_path, kind):
    whole = run(tmp_path / "a", kind)

    def crash(step, run_):
        if step == 3:
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        run(tmp_path / "b", kind, "train.save_every=2", hooks=Hooks(before_step=crash))
    resumed = run(tmp_path / "b", kind, "train.save_every=2", "train.resume=auto")
    a, b = adapter(whole), adapter(resumed)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in whole.history[2:]] == [h["loss"] for h in resumed.history]
    assert whole.history[-1]["loss"] < whole.history[0]["loss"]


def test_the_nats_per_token_guard_is_not_applied_to_dpos_summed_log_probs(tmp_path, capsys):
    """DPO's eval/logps/chosen is a sum per response (TRL); the chosen_logps_drop_warn margin is
    nats/token, so a DPO run never gets that warning, even when the sum falls."""
    result = run(tmp_path, "dpo", "train.learning_rate=5e-2", "train.chosen_logps_drop_warn=1e-9")
    assert result.evals[2]["eval/logps/chosen"] < result.evals[0]["eval/logps/chosen"]  # it did fall
    assert "eval/logps/chosen is" not in capsys.readouterr().err


def test_dpo_ipos_per_token_log_probs_get_the_drop_warning(tmp_path, capsys):
    """ipo's eval/logps/chosen is a mean per token (the log-probs its loss scores), the unit of
    chosen_logps_drop_warn, so a fall beyond the margin warns, as for ORPO."""
    result = run(tmp_path, "dpo", "objective.loss_type=ipo", "train.learning_rate=5e-2",
                 "train.chosen_logps_drop_warn=1e-9")
    base, now = result.evals[0]["eval/logps/chosen"], result.evals[4]["eval/logps/chosen"]
    assert -20 < now < base < 0  # nats/token, and it fell
    assert f"warning: step 4: held-out eval/logps/chosen is {now:.4f}, {base - now:.4f} nats/token below" \
        in capsys.readouterr().err


def test_a_resume_without_the_cache_recomputes_the_step_0_reference_not_the_resumed_weights(tmp_path):
    seen = []

    def crash(step, run_):
        if step == 3:
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        run(tmp_path, "dpo", "train.save_every=2", hooks=counting_hooks(seen, before_step=crash))
    files = sorted((tmp_path / "data_cache").glob("reference-*.npz"))
    assert len(files) == 2  # train and valid
    before = [np.load(f) for f in files]
    for f in files:
        f.unlink()
    seen.clear()
    run(tmp_path, "dpo", "train.save_every=2", "train.resume=auto", hooks=counting_hooks(seen))
    assert len(seen) == N_TRAIN + N_VALID
    for f, values in zip(files, before):  # the same model: step 0's, before the checkpoint's weights
        assert np.array_equal(np.load(f), values)


def test_a_reference_cache_that_cannot_be_written_costs_only_the_next_runs_pass(tmp_path, monkeypatch):
    """A full disk (or a read-only data_cache) while writing OUT/data_cache/reference-*.npz ended the run
    with a raw OSError (a traceback from the command line); like the tokenized pairs' cache, the entry is
    skipped and the run trains on."""
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(np, "savez", full)
        result = run(tmp_path, "dpo")
    assert len(result.history) == 4 and (Path(result.adapter_dir) / "adapters.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "data_cache").iterdir()) == []  # no entry, no temporary file
    cached, fresh = adapter(result), adapter(run(tmp_path / "again", "dpo"))  # the values computed were used
    assert cached.keys() == fresh.keys() and all(np.array_equal(cached[k], fresh[k]) for k in cached)


def test_a_damaged_reference_cache_entry_is_absent_not_a_traceback(tmp_path):
    """A reference cache entry whose header a flipped bit or a cut made unparseable raised tokenize.TokenError or
    SyntaxError from numpy's header parser out of the DPO setup (a traceback), and one whose values a flipped bit
    changed (a .npy has no checksum) was read as it was: every such entry counts as absent (recomputed)."""
    from dtrain.run.reference import load, save

    path, values = tmp_path / "reference-k-train.npz", np.arange(40, dtype=np.float32).reshape(20, 2)
    save(path, values)
    good = path.read_bytes()
    damaged = [good[:n] for n in range(len(good))]
    damaged += [bytes(b ^ (1 << bit) if i == at else b for i, b in enumerate(good))
                for at in range(len(good)) for bit in range(8)]
    for data in damaged:
        path.write_bytes(data)
        got = load(path, 20)
        assert got is None or np.array_equal(got, values)


def test_reference_cache_entries_follow_the_umask_like_other_outputs(tmp_path):
    """Entries were written through mkstemp, whose files are 0600 whatever the umask (the tokenized pairs'
    entries beside them follow the umask)."""
    import os

    from dtrain.run.reference import save

    old = os.umask(0o022)
    try:
        save(tmp_path / "reference-k-train.npz", np.zeros((2, 2), dtype=np.float32))
    finally:
        os.umask(old)
    assert [(p.name, oct(p.stat().st_mode & 0o777)) for p in tmp_path.iterdir()] == [("reference-k-train.npz",
                                                                                      oct(0o644))]


def test_an_sft_runs_summary_reports_the_held_out_nll(tmp_path):
    """SFT logs no reward accuracy: `dtrain train` printed the summary with a KeyError after the
    adapter was written (seen on the GPU, bench/objectives.py); it reports the held-out NLL."""
    result = run(tmp_path, "sft")
    first, last = result.evals[0]["eval/nll_loss"], result.evals[4]["eval/nll_loss"]
    assert "eval/rewards/accuracies" not in result.evals[4]
    assert result.summary() == f"eval NLL of the completions: step 0 {first:#.4g} -> step 4 {last:#.4g}"


def test_the_summary_of_an_sft_run_with_completion_only_loss_false_names_the_prompts_too(tmp_path):
    """Its eval/nll_loss counts the prompt tokens after the first as well: the summary called it the NLL
    of the completions."""
    result = run(tmp_path, "sft", "objective.completion_only_loss=false")
    first, last = result.evals[0]["eval/nll_loss"], result.evals[4]["eval/nll_loss"]
    assert result.summary() == f"eval NLL of the prompts and completions: step 0 {first:#.4g} -> step 4 {last:#.4g}"


def test_reference_cache_key_tells_a_quantized_model_s_float_types_apart(tmp_path):
    """A quantized model's first parameter is its packed uint32 weights: the key named the dtype 'uint32' in
    bfloat16 and float16 alike, so a float16 run read a bfloat16 run's reference log-probs from the cache."""
    import mlx.nn as nn

    from dtrain.distributed import Group
    from dtrain.run.reference import reference_pass

    cfg = config(tmp_path / "out", "dpo")
    data = SimpleNamespace(train=make_pairs(3, seed=1), valid=make_pairs(2, seed=2))
    refs = {}
    for dtype in (mx.bfloat16, mx.float16):
        model = make_tiny_model(seed=0, hidden_size=64, intermediate_size=128)
        nn.quantize(model, group_size=32, bits=4)
        model.set_dtype(dtype)
        said = []
        out = reference_pass(cfg, model, data, "tiny", Group(), ReferenceEngine(model, ReferenceLogps()),
                             tmp_path / "cache", said.append, init_adapter=None, settings="reference")
        assert said[0].endswith("computed"), (dtype, said)
        refs[dtype] = [p.extra["ref_chosen"] for p in out.train]
    assert len(list((tmp_path / "cache").glob("reference-*-train.npz"))) == 2
    assert refs[mx.bfloat16] != refs[mx.float16]


def test_reference_pass_shows_a_progress_bar_per_split(tmp_path, monkeypatch):
    """The reference pass ran a forward over every pair before step 1 with nothing on the screen (a minute
    for 25 pairs of 256 tokens on 2 CPU cores); it counts the pairs of each split in a bar, as tokenization."""
    import tqdm

    from dtrain.distributed import Group
    from dtrain.run.reference import reference_pass

    bars = []

    class Bar:
        def __init__(self, total, desc, disable, **_):
            self.total, self.desc, self.disable, self.done = total, desc, disable, 0
            bars.append(self)

        def update(self, n):
            self.done += n

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    cfg = config(tmp_path / "out", "dpo", "train.progress=true")
    data = SimpleNamespace(train=make_pairs(3, seed=1), valid=make_pairs(2, seed=2))
    model = make_tiny_model(seed=0)
    reference_pass(cfg, model, data, "tiny", Group(), ReferenceEngine(model, ReferenceLogps()), tmp_path / "cache",
                   None, init_adapter=None, settings="reference")
    assert [(b.desc, b.total, b.done, b.disable) for b in bars] == [
        ("DPO reference log-probs train", 3, 3, False), ("DPO reference log-probs valid", 2, 2, False)]


@pytest.mark.parametrize("loss_type, step_1", [("sigmoid", math.log(2.0)), ("ipo", 1 / (4 * 0.1 ** 2)), ("hinge", 1.0)])
def test_dpo_step_1_loss_is_the_documented_value_of_each_loss_type(tmp_path, loss_type, step_1):
    """At step 1 the policy is the reference (h = 0): README and docs/objectives.md give ln 2 for sigmoid,
    1/(4 beta^2) for ipo and 1 for hinge (they said ln 2 for every loss type)."""
    result = run(tmp_path, "dpo", f"objective.loss_type={loss_type}", "train.steps=1")
    assert result.history[0]["loss"] == pytest.approx(step_1, rel=1e-6)
    assert result.history[0]["rewards/margins"] == 0.0


@pytest.mark.parametrize("changed", ["train.micro_batch_pairs=1", "engine.kind=reference",
                                     "engine.memory_budget_gb=1e-6"])  # a budget that changes the auto plan
def test_a_run_with_other_micro_batches_or_engine_does_not_read_the_last_runs_reference_cache(tmp_path, changed):
    """The reference values depend on how the pairs are cut (the padding of a micro-batch changes the
    rounding) and on the engine: a run that ended before its first save (here at step 1; an
    out-of-memory error, say) and then started again in the same folder with smaller micro-batches or
    another engine read the first run's cached values, so its held-out pairs' step-0 log-probs were not
    the reference's bit for bit and its step-0 rewards were rounding noise, not 0."""
    from dtrain.errors import UserError

    def crash(step, run_):
        raise RuntimeError("out of memory")

    with pytest.raises(UserError, match="^out of memory after step 0"):
        run(tmp_path, "dpo", "train.micro_batch_pairs=3", hooks=Hooks(before_step=crash))
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    again = run(tmp_path, "dpo", "train.micro_batch_pairs=3", changed)
    start = again.evals[0]
    assert start["eval/rewards/chosen"] == start["eval/rewards/rejected"] == start["eval/rewards/margins"] == 0.0


def test_sft_trains_the_preference_rows_a_pairwise_objective_drops(tmp_path):
    """A file of preference rows with identical sides (or sides cut to the same ids, or no rejected side)
    stopped an SFT run with 'no usable training pairs': the data layer applied the pairwise rules. SFT
    trains every row's chosen side; ORPO still drops them."""
    from conftest import make_tokenizer
    from test_data_sft import PAIRWISE_ONLY, write_rows
    from dtrain.errors import DataError

    path = write_rows(tmp_path / "p.jsonl", PAIRWISE_ONLY[:4])  # none a pairwise objective can train
    stepped = []

    def recording(engine):
        class Recording:
            name, objective = engine.name, engine.objective

            def step(self, chunk, totals, key=None, hyper=None):
                stepped.extend((p.source, p.rejected) for p in chunk)
                return engine.step(chunk, totals, key, hyper)

        return Recording()

    over = [f"data.train={path}", "data.demo_pairs=0", "data.valid_fraction=0", "data.max_length=23",
            "data.max_prompt_length=20", "train.global_batch_pairs=4", "train.micro_batch_pairs=4",
            "train.steps=1", "train.eval_every=0"]
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=make_tokenizer(), identity="tiny",
                             source="tiny-llama", reference={"path": "tiny-llama"})
    train(config(tmp_path / "sft", "sft", *over), loaded=loaded, hooks=Hooks(engine=recording))
    assert sorted(stepped) == [(f"{path}:{i}", []) for i in range(1, 5)]
    with pytest.raises(DataError, match=r"no usable training pairs in .*p.jsonl \(2 bad rows, 2 dropped"):
        train(config(tmp_path / "orpo", "orpo", *over), loaded=loaded)


def test_a_dpo_restart_on_another_device_does_not_read_the_reference_its_auto_engine_computed(tmp_path, monkeypatch):
    """The reference cache was keyed by the engine settings as written (engine.kernels: auto), not as
    resolved: a run that ended before its first save on a GPU (kernels mlx), started again in the same
    folder on the CPU (kernels dtrain), read the GPU's values, so step 0's held-out rewards were rounding
    noise, not 0."""
    def crash(step, run_):
        raise RuntimeError("interrupted")

    with monkeypatch.context() as gpu:
        gpu.setattr("dtrain.device.default_kernels", lambda: "mlx")
        with pytest.raises(RuntimeError, match="interrupted"):
            run(tmp_path, "dpo", hooks=Hooks(before_step=crash))
    seen = []
    result = run(tmp_path, "dpo", hooks=counting_hooks(seen))
    assert len(seen) == N_TRAIN + N_VALID  # computed again, by this device's engine
    assert result.evals[0]["eval/rewards/margins"] == 0.0 and result.evals[0]["eval/rewards/accuracies"] == 0.0


@pytest.mark.parametrize("change", [["engine.kind=segmented", "engine.segment_layers=auto"],  # what auto is
                                    ["engine.length_bucket=0", "engine.kernels=dtrain"],  # auto on the CPU
                                    ["lora.rank=4", "lora.scale=3.0"],  # a new LoRA's lora_b is 0: adds nothing
                                    # the same plan within another budget (Metal's moves with the memory in use)
                                    ["engine.memory_budget_gb=64"]])
def test_a_dpo_restart_with_settings_that_give_the_same_reference_reads_it(tmp_path, change):
    def crash(step, run_):
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        run(tmp_path, "dpo", hooks=Hooks(before_step=crash))
    seen = []
    result = run(tmp_path, "dpo", *change, hooks=counting_hooks(seen))
    assert seen == []
    assert result.evals[0]["eval/rewards/margins"] == 0.0


# One case per objective: its settings and an engine setting the others do not take (reference engine; ranges
# with a chunked head; the single pass over prefix-shared, packed, bucketed rows; compiled ranges)
LOOP_CASES = {
    "orpo": ["orpo.lambda=0.5", "engine.kind=segmented", "engine.segment_layers=1", "engine.head_chunk_tokens=3",
             "lora.plus_ratio=4", "train.weight_decay=0.1"],
    "orpo_response": ["orpo.lambda=2.0", "orpo.nll_scope=response", "engine.kind=reference", "train.grad_clip=0.05"],
    "dpo": ["objective.kind=dpo", "objective.beta=0.5", "engine.length_bucket=8", "train.schedule=cosine"],
    "dpo_ipo": ["objective.kind=dpo", "objective.loss_type=ipo", "objective.beta=0.5", "engine.kind=segmented",
                "engine.segment_layers=2", "engine.compile=true", "engine.prefix_sharing=false"],
    "simpo": ["objective.kind=simpo", "objective.beta=2.5", "objective.simpo_gamma=0.3", "objective.nll_weight=0.5",
              "engine.pack=false", "train.warmup_steps=2"],
    "sft": ["objective.kind=sft", "objective.completion_only_loss=false", "engine.kind=segmented",
            "engine.segment_layers=1", "lora.plus_ratio=4"],
}


def loop_pairs(sft: bool) -> list:
    """Edge shapes: 1-token responses, a long chosen and a long rejected side, two pairs of one prompt, a rejected
    side with its own prompt (two sequences under prefix sharing), a 1-token prompt; SFT rows for ``sft``."""
    from dtrain.types import TokenizedPair

    rng = np.random.default_rng(7)
    ids = lambda n: rng.integers(5, 512, n).tolist()  # noqa: E731
    shared = ids(5)
    shapes = [(4, 1, 6), (3, 7, 1), (2, 22, 3), (6, 2, 19), (1, 3, 4), (5, 4, 4), (3, 5, 2), (4, 2, 3), (2, 6, 5)]
    pairs = [TokenizedPair(shared if i in (1, 5) else ids(p), ids(c), ids(r), f"t:{i}")
             for i, (p, c, r) in enumerate(shapes)]
    pairs[6] = TokenizedPair(pairs[6].prompt, pairs[6].chosen, pairs[6].rejected, "t:6", rejected_prompt=ids(3))
    if sft:
        pairs[2:5] = [TokenizedPair(p.prompt, p.chosen, [], p.source) for p in pairs[2:5]]
    return pairs


def side(model, prompt: list, response: list):
    """``(log-probs of the prompt tokens after the first, of the response)`` under ``model`` run on
    ``prompt + response`` alone (mlx-lm's forward), float32."""
    logits = model(mx.array([prompt + response]))[0].astype(mx.float32)  # (P + R, V)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = logp[mx.arange(len(prompt) + len(response) - 1), mx.array(prompt[1:] + response)]
    return picked[: len(prompt) - 1], picked[len(prompt) - 1:]


def by_hand(model, pairs, cfg, hyper, ref=None):
    """``(the objective's loss, its TRL-named metrics, per-pair margins)`` of ``pairs`` in float32: each side run
    alone through mlx-lm's model, then the formulas of docs/objectives.md (ORPO: Hong et al. 2024 eq. 6-7; DPO:
    Rafailov et al. 2023 eq. 7, IPO: Azar et al. 2023 eq. 17; SimPO: Meng et al. 2024 eq. 6). ``ref``: DPO's
    ``(chosen, rejected)`` summed log-probs of the step-0 model per pair."""
    import mlx.nn as nn

    kind = cfg.objective.kind
    sft_full = kind == "sft" and not cfg.objective.completion_only_loss
    full = cfg.orpo.nll_scope == "full" if kind == "orpo" else sft_full  # prompt tokens after the first: NLL targets
    nll, n_nll, chosen, rejected, c_len, r_len = 0.0, 0, [], [], [], []
    for p in pairs:
        prompt_lp, c = side(model, p.prompt, p.chosen)
        nll = nll - c.sum() - (prompt_lp.sum() if full else 0.0)
        n_nll += len(p.chosen) + (len(p.prompt) - 1 if full else 0)
        r = side(model, p.rejected_prompt or p.prompt, p.rejected)[1] if p.rejected else mx.zeros(1)
        chosen.append(c.sum()), rejected.append(r.sum()), c_len.append(len(c)), r_len.append(max(len(p.rejected), 1))
    nll, chosen, rejected = nll / n_nll, mx.stack(chosen), mx.stack(rejected)
    c_len, r_len = mx.array(c_len, mx.float32), mx.array(r_len, mx.float32)
    lw, lr = chosen / c_len, rejected / r_len  # mean log-probs per token
    if kind == "sft":
        return nll, {"loss": nll, "nll_loss": nll, "logps/chosen": lw.mean()}, None
    if kind == "dpo":
        rc, rr = (mx.array([x[i] for x in ref]) for i in (0, 1))
        b = hyper["beta"]
        if cfg.objective.loss_type == "ipo":  # means per token, policy and reference (TRL)
            chosen, rejected, rc, rr = lw, lr, rc / c_len, rr / r_len
        h = (chosen - rc) - (rejected - rr)
        losses = nn.softplus(-b * h) if cfg.objective.loss_type == "sigmoid" else (h - 1 / (2 * b)) ** 2
        return losses.mean(), {"loss": losses.mean(), "rewards/chosen": b * (chosen - rc).mean(),
                               "rewards/rejected": b * (rejected - rr).mean(), "rewards/accuracies": (h > 0).mean(),
                               "rewards/margins": b * h.mean(), "logps/chosen": chosen.mean(),
                               "logps/rejected": rejected.mean()}, h
    scale = hyper["lambda"] if kind == "orpo" else hyper["beta"]
    metrics = {"nll_loss": nll, "rewards/chosen": scale * lw.mean(), "rewards/rejected": scale * lr.mean(),
               "rewards/accuracies": (lw > lr).mean(), "rewards/margins": scale * (lw - lr).mean(),
               "logps/chosen": lw.mean(), "logps/rejected": lr.mean()}
    if kind == "simpo":
        per = nn.softplus(-(hyper["beta"] * (lw - lr) - hyper["gamma"]))
        loss = hyper["nll_weight"] * nll + per.mean()
        return loss, {**metrics, "loss": loss, "simpo_loss": per.mean()}, lw - lr
    log1mexp = lambda x: mx.log(-mx.expm1(x))  # noqa: E731
    log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))
    loss = nll - hyper["lambda"] * nn.log_sigmoid(log_odds).mean()
    return loss, {**metrics, "loss": loss, "log_odds_ratio": nn.log_sigmoid(log_odds).mean(),
                  "log_odds_chosen": log_odds.mean()}, lw - lr


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_every_step_trains_and_logs_what_an_independent_loop_computes(tmp_path, case):
    """Each step of a run (3 steps of 4 pairs in micro-batches of 3: an odd split; edge shapes, ``loop_pairs``)
    against a loop written apart from dtrain's from dtrain's weights before the step: its logged metrics (TRL's
    names, means over the step's pairs) and grad_norm equal :func:`by_hand`'s and the gradient of its loss (to
    float32 rounding), its update is AdamW's (bias-corrected, decoupled weight decay, LoRA+ on lora_b, the
    global-norm clip, warmup then the schedule), and the held-out metrics at steps 0 and 3 equal
    :func:`by_hand`'s; for DPO, each pair's reference log-probs are the step-0 model's."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map, tree_unflatten

    before, batches, trained = {}, {}, {}

    def record(step, run_):
        before[step] = dict(tree_flatten(tree_map(mx.array, run_.model.trainable_parameters())))
        batches[step] = run_.step.sampler.take(step, run_.step.pairs, 0, 1, 1)[0]
        trained.update({p.source: p for p in (*run_.step.pairs, *run_.valid)})  # DPO's: with reference log-probs
        before["hyper"] = {k: float(v) for k, v in run_.step.hyper.items()}

    cfg = config(tmp_path, "orpo", "train.steps=3", "train.micro_batch_pairs=3", "train.eval_every=0",
                 "train.warmup_steps=1", "train.learning_rate=2e-2", "engine.kernels=dtrain", *LOOP_CASES[case])
    pairs = loop_pairs(cfg.objective.kind == "sft")
    model = make_tiny_model(seed=1)
    loaded = SimpleNamespace(aliases=(), model=model, tokenizer=None, identity="tiny", source="tiny-llama",
                             reference={"path": "tiny-llama"})
    result = train(cfg, loaded=loaded, dataset=SimpleNamespace(train=pairs[:7], valid=pairs[7:], fingerprint="fp"),
                   hooks=Hooks(before_step=record))
    before[4] = dict(tree_flatten(model.trainable_parameters()))
    hyper, t = before["hyper"], cfg.train
    model.update(tree_unflatten(list(before[1].items())))
    model.eval()
    ref = {p.source: [float(side(model, prompt, response)[1].sum()) for prompt, response in
                      ((p.prompt, p.chosen), (p.rejected_prompt or p.prompt, p.rejected))]
           for p in pairs} if cfg.objective.kind == "dpo" else {}
    for source, (chosen, rejected) in ref.items():  # the run's reference pass: the step-0 model's sums
        extra = trained[source].extra
        assert extra["ref_chosen"] == pytest.approx(chosen, rel=1e-5) and \
            extra["ref_rejected"] == pytest.approx(rejected, rel=1e-5), source
    refs = lambda batch: [ref[p.source] for p in batch] if ref else None  # noqa: E731

    def close(got, want, what, tol=1e-5, ties=0):
        assert abs(got - want) <= tol * max(1.0, abs(want)) + ties, (what, got, want)

    for when, weights in ((0, before[1]), (3, before[4])):  # held-out metrics
        model.update(tree_unflatten(list(weights.items())))
        _, want, margins = by_hand(model, pairs[7:], cfg, hyper, refs(pairs[7:]))
        for k, v in want.items():
            tied = 0 if margins is None or k != "rewards/accuracies" else float((mx.abs(margins) < 1e-4).mean())
            close(result.evals[when]["eval/" + k], float(v), (when, k), ties=tied)
    model.train()
    m, v = ({k: mx.zeros_like(x) for k, x in before[1].items()} for _ in range(2))
    for step in (1, 2, 3):
        model.update(tree_unflatten(list(before[step].items())))
        batch = batches[step]
        loss_of = lambda model: by_hand(model, batch, cfg, hyper, refs(batch))[0]  # noqa: E731
        _, grads = nn.value_and_grad(model, loss_of)(model)
        _, want, margins = by_hand(model, batch, cfg, hyper, refs(batch))
        logged = result.history[step - 1]
        for k, value in want.items():
            tied = 0 if margins is None or k != "rewards/accuracies" else float((mx.abs(margins) < 1e-4).mean())
            close(logged[k], float(value), (step, k), ties=tied)
        g = dict(tree_flatten(grads))
        norm = math.sqrt(sum(float((x * x).sum()) for x in g.values()))
        close(logged["grad_norm"], norm, (step, "grad_norm"), tol=1e-4)
        clip = min(1.0, t.grad_clip / norm) if t.grad_clip > 0 else 1.0
        lr = t.learning_rate * min(1.0, step / t.warmup_steps)  # linear warmup, then the schedule to 0.1x at step 3
        if t.schedule == "cosine" and step > t.warmup_steps:
            lr *= 0.1 + 0.45 * (1 + math.cos(math.pi * (step - t.warmup_steps) / (3 - t.warmup_steps)))
        assert logged["learning_rate"] == pytest.approx(lr, rel=1e-12)
        # AdamW (Loshchilov & Hutter 2019, with PyTorch's bias correction), lora_b at plus_ratio times the rate
        moved, want_moved = [], []
        for k, p in before[step].items():
            m[k] = 0.9 * m[k] + 0.1 * g[k] * clip
            v[k] = 0.999 * v[k] + 0.001 * (g[k] * clip) ** 2
            rate = lr * (cfg.lora.plus_ratio if k.endswith("lora_b") else 1.0)
            adam = (m[k] / (1 - 0.9**step)) / (mx.sqrt(v[k] / (1 - 0.999**step)) + 1e-8)
            want_moved.append((-rate * (adam + t.weight_decay * p)).reshape(-1))
            moved.append((before[step + 1][k] - p).reshape(-1))
        moved, want_moved = mx.concatenate(moved), mx.concatenate(want_moved)
        assert float(mx.linalg.norm(moved - want_moved)) <= 1e-4 * float(mx.linalg.norm(want_moved)), step



def readme_tags() -> set:
    """The metric names README.md's "Objective and metrics" section writes in backticks, braces expanded."""
    text = (Path(__file__).parents[1] / "README.md").read_text().split("### Objective and metrics")[1].split("\n#")[0]
    names = set()
    for quoted in re.findall(r"`([^`\s]+)`", text):
        if m := re.fullmatch(r"(.*)\{([^}]*)\}(.*)", quoted):
            names |= {m[1] + part + m[3] for part in m[2].split(",")}
        else:
            names.add(quoted)
    return names


@pytest.mark.parametrize("kind", ["orpo", "dpo", "simpo", "sft"])
def test_every_tensorboard_tag_a_run_writes_is_named_in_the_readme(tmp_path, kind):
    result = run(tmp_path, kind, "train.keep_best=eval/loss")
    documented = readme_tags()
    tags = {re.sub(r"^(hparam/)?(eval/)?", "", tag) for tag in read_scalars(result.run_dir)}  # eval/: the same names
    tags = {"best/<metric>" if tag.startswith("best/") and tag != "best/step" else tag for tag in tags}
    assert "train/beta" in tags or kind not in ("dpo", "simpo")  # the objective's hyper-parameters are logged
    assert sorted(tags - documented) == []


@pytest.mark.parametrize("kind", ["orpo", "sft"])
def test_tokens_per_second_counts_the_pairs_tokens_whatever_layout_the_engine_runs(tmp_path, kind):
    """``tokens_per_second`` is the step's pairs as two sequences in full (``[prompt; chosen]`` and
    ``[prompt; rejected]``, an SFT row's first alone; TRL's ``num_tokens``) per second: the same count under
    prefix sharing (the prompt run once), without it and on the reference engine, so the rate compares across
    engines. Prefix sharing counted its prompts once: step 1's 71 tokens were logged as 53."""
    from dtrain.sampler import Sampler

    pairs = make_pairs(N_TRAIN + N_VALID, seed=0)
    pairs[3] = pairs[3].__class__(pairs[3].prompt, pairs[3].chosen, pairs[3].rejected, pairs[3].source,
                                  rejected_prompt=[1, 7, 8])  # a fallback pair: its own rejected prompt
    steps = [[pairs[i] for _, i in Sampler(N_TRAIN, 4, 0).global_batch(s)] for s in (1, 2)]
    want = [sum(len(p.prompt) + len(p.chosen) + (len(p.rejected_prompt or p.prompt) + len(p.rejected)
                                                  if kind != "sft" else 0) for p in batch) for batch in steps]
    for engine in (["engine.prefix_sharing=true"], ["engine.prefix_sharing=false"], ["engine.kind=reference"]):
        loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=None, identity="tiny",
                                 source="tiny-llama", reference={"path": "tiny-llama"})
        dataset = SimpleNamespace(train=pairs[:N_TRAIN], valid=pairs[N_TRAIN:], fingerprint="fp")
        out = tmp_path / engine[0]
        result = train(config(out, kind, "train.steps=2", "train.eval_every=0", *engine), loaded=loaded, dataset=dataset)
        counted = [h["tokens_per_second"] * h["perf/step_seconds"] for h in result.history]
        assert counted == pytest.approx(want, rel=1e-9), engine
