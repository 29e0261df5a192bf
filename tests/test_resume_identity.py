"""What a resume accepts and refuses, key by key from the config schema; the
learning rate past the planned steps; an idempotent end of run; run files
relative to the output folder (issue 22, sections 2 and 3)."""

import dataclasses
import json
import os
import shutil
import signal
import typing

import pytest

from dtrain.run import checkpoint as ckpt
from dtrain import identity
from dtrain.config import Config, describe_fields, load_config, to_dict
from dtrain.config_checks import OBJECTIVE_KEYS, unread, yaml_key
from dtrain.errors import UserError
from dtrain.run.optimizer import learning_rate
from dtrain.run.tracking import read_events, read_scalars
from test_trainer import run


def test_every_config_key_is_classified_once():
    keys = identity.config_keys()
    assert identity.unclassified() == []
    tables = [identity.REFUSED, identity.BY_CONTENT, identity.ACCEPTED]
    assert sorted(k for t in tables for k in t) == sorted(keys)  # none twice, none stale


def test_an_unclassified_key_stops_every_run(monkeypatch):
    monkeypatch.delitem(identity.ACCEPTED, "train.progress")
    with pytest.raises(RuntimeError, match=r"not classified for resume in dtrain/identity.py: train.progress$"):
        identity.settings(to_dict(Config()))


def changed_value(tp, default, meta):
    """A valid value of a config field other than ``default``, from its type and allowed values."""
    if meta.get("choices"):
        return next(c for c in meta["choices"] if c != default)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        if default is None:
            return changed_value(inner[0], {str: "", list: [], dict: {}}.get(inner[0], 0), meta)
        if default != "auto":
            return "auto"
        plain = next(a for a in inner if typing.get_origin(a) is not typing.Literal)
        return changed_value(plain, {bool: False, int: 0}[plain], meta)
    if tp is bool:
        return not default
    if tp is int:
        return 1 if default == -1 else default + 1  # -1 = all; 0 is refused there (lora.num_layers)
    if tp is float:
        hi = meta.get("below")
        return (default + hi) / 2 if hi is not None else default + 0.5
    if tp is str:
        return default + "-moved"
    if tp is list:
        return ["self_attn.q_proj"]
    if tp is dict:
        return {"prompt": "question"}
    raise AssertionError(f"no generated value for {tp}")


def schema():
    """``(section.key, changed value)`` for every key of the config, read from the dataclasses."""
    cfg = Config()
    for section in dataclasses.fields(cfg):
        for key, tp, default, meta in describe_fields(type(getattr(cfg, section.name))):
            dotted = f"{section.name}.{key}"
            yield dotted, {"data.template_date": "2024-07-26"}.get(dotted) or changed_value(tp, default, meta)


def state_for(resolved):
    return ckpt.RunState(step=2, skipped_steps=0, run_id="r", settings=identity.settings(resolved), schedule_steps=4,
                         world_size=1, data={"training pairs": 9}, model="m", lora_shapes={"a": [2, 2]},
                         position={"next_pairs": [1, 2]})


@pytest.mark.parametrize("key, value", list(schema()), ids=lambda x: x if isinstance(x, str) else None)
def test_each_config_key_is_refused_or_accepted_by_its_class(tmp_path, key, value):
    """A change of one key at a time: REFUSED keys name the key and both values; the others continue."""
    base = to_dict(Config())
    now = json.loads(json.dumps(base))
    section, name = key.split(".", 1)
    now[section][name] = value
    kinds = OBJECTIVE_KEYS.get((section, name.replace("lambda", "lam")))
    reader = [f"objective.kind={kinds[0]}"] if kinds and "orpo" not in kinds else []  # a kind that reads the key
    reader += {"orpo.lambda_schedule": ["train.eval_every=1"], "train.keep_best": ["train.eval_every=1"],
               "train.early_stop_evals": ["train.eval_every=1", "train.keep_best=eval/loss"],
               "train.keep_best_guard": ["train.eval_every=1", "train.keep_best=eval/loss"]}.get(key, [])
    text = value if isinstance(value, str) else json.dumps(value)  # a str key's override is its text as given
    # no demo pairs, as the checkpoints' configs (they leave data.format unread, and refuse held-out data)
    cfg = load_config(None, [f"{key}={text}", *reader, "data.train=pairs.jsonl"]
                      if key not in ("data.train", "data.demo_pairs")
                      else [f"{key}={text}"])  # the generated value is one the config accepts
    saved, current = state_for(base), state_for(now)
    # a key the run leaves unread (the controller's under the default static schedule) decides nothing
    if key in identity.REFUSED and key not in {f"{s}.{yaml_key(n)}" for s, n in unread(cfg)}:
        with pytest.raises(UserError) as err:
            ckpt.check_resumable(saved, current, [1, 2], tmp_path)
        old = base[section][name]
        assert str(err.value) == (f"resume: {tmp_path} was made with different settings: {key}: {old!r} in the "
                                  f"checkpoint, {value!r} now. {ckpt.RESUME_HINT}")
    else:
        ckpt.check_resumable(saved, current, [1, 2], tmp_path)


@pytest.mark.parametrize("override", ["engine.kind=reference", "engine.segment_layers=1", "engine.prefix_sharing=false",
                                      "engine.head_chunk_tokens=4", "train.micro_batch_pairs=2", "train.eval_every=1",
                                      "train.save_every=1", "train.keep_last=3", "data.on_bad_row=error",
                                      "distributed.check_sync_every=1", "train.max_skipped_steps=2",
                                      "train.chosen_logps_drop_warn=0.5", "train.steps=5"])
def test_accepted_keys_continue_a_real_run(tmp_path, override):
    assert override.split("=")[0] in identity.ACCEPTED
    run(tmp_path, "train.steps=2")
    more, _ = run(tmp_path, "train.steps=4", "train.resume=auto", override)
    assert [h["learning_rate"] > 0 for h in more.history] == [True] * (3 if override == "train.steps=5" else 2)


@pytest.mark.parametrize("override, changed", [
    ("lora.scale=40", "lora.scale: 20.0 in the checkpoint, 40.0 now"),
    ("lora.dropout=0.2", "lora.dropout: 0.0 in the checkpoint, 0.2 now"),
    ("orpo.lambda=0.5", "orpo.lambda: 0.1 in the checkpoint, 0.5 now"),
    ("lora.rank=4", "lora.rank: 2 in the checkpoint, 4 now"),
    ("train.learning_rate=0.02", "train.learning_rate: 0.01 in the checkpoint, 0.02 now"),
])
def test_issue_examples_are_refused_naming_key_and_values(tmp_path, override, changed):
    run(tmp_path, "train.steps=2")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file() and p.name != ".dtrain.lock")
    with pytest.raises(UserError) as err:
        run(tmp_path, "train.steps=4", "train.resume=auto", override)
    assert str(err.value) == (f"resume: {tmp_path}/checkpoints/step-0000002 was made with different settings: "
                              f"{changed}. {ckpt.RESUME_HINT}")
    after = sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file() and p.name != ".dtrain.lock")
    assert after == before


def test_longer_train_steps_hold_the_final_rate_of_the_planned_schedule(tmp_path):
    """A finished 10-step linear run resumed with train.steps=14: steps 11-14 keep step 10's 1e-5, no jump."""
    args = ("train.schedule=linear", "train.warmup_steps=2", "train.learning_rate=1e-4", "train.eval_every=0")
    first, _ = run(tmp_path, "train.steps=10", *args)
    more, _ = run(tmp_path, "train.steps=14", "train.resume=auto", *args)
    rates = [h["learning_rate"] for h in first.history + more.history]
    expected = [5e-5, 1e-4] + [1e-4 - 9e-5 * (s - 2) / 8 for s in range(3, 11)] + [1e-5] * 4
    assert rates == pytest.approx(expected, rel=1e-12, abs=0)
    assert rates[9] == rates[10] == pytest.approx(1e-5, rel=1e-12)
    lr = read_scalars(more.run_dir)["learning_rate"]
    assert [s for s, _ in lr] == list(range(1, 15))
    state = json.loads((tmp_path / "checkpoints" / "step-0000014" / "state.json").read_text())
    assert state["schedule_steps"] == 10


def test_readme_continuation_of_the_demo_has_no_jump():
    """configs/demo.yaml (12 steps, cosine) continued to 24: before, 2.0e-5 at step 12 then 1.17e-4 at step 13."""
    t = load_config("configs/demo.yaml").train
    assert learning_rate(12, t) == pytest.approx(2.0e-5, rel=1e-12)
    longer = dataclasses.replace(t, steps=24)
    assert learning_rate(13, longer) == pytest.approx(1.1672e-4, rel=1e-4)  # the old jump: re-planned for 24
    assert [learning_rate(s, longer, schedule_steps=12) for s in (12, 13, 24)] == [pytest.approx(2.0e-5, rel=1e-12)] * 3


def test_resume_of_a_finished_run_evaluates_saves_and_logs_nothing_again(tmp_path):
    first, _ = run(tmp_path, "train.steps=2")
    ckpt_dir = tmp_path / "checkpoints" / "step-0000002"
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ckpt_dir.iterdir()}
    again, _ = run(tmp_path, "train.steps=2", "train.resume=auto")
    assert again.history == [] and again.evals == first.evals
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ckpt_dir.iterdir()} == files
    scalars = read_scalars(again.run_dir)
    assert [s for s, _ in scalars["eval/loss"]] == [0, 2]
    assert [s for s, _ in scalars["hparam/loss"]] == [2]
    tags = [v.tag for e in read_events(again.run_dir) for v in e.summary.value]
    assert tags.count("_hparams_/experiment") == 1
    assert (again.adapter_dir / "adapters.safetensors").read_bytes() == (
        first.adapter_dir / "adapters.safetensors").read_bytes()


def test_a_final_step_saved_by_a_stop_is_evaluated_once_on_resume(tmp_path):
    """A stop at the last step saves before the final eval; the resume does that eval, once."""
    from dtrain.run.trainer import Hooks

    def stop_at_last(step, run_):
        if step == 2:
            run_.stop.requested = True

    stopped, _ = run(tmp_path, "train.steps=2", hooks=Hooks(before_step=stop_at_last))
    assert stopped.stopped and sorted(stopped.evals) == [0]
    resumed, _ = run(tmp_path, "train.steps=2", "train.resume=auto")
    assert resumed.history == [] and sorted(resumed.evals) == [0, 2]
    assert [s for s, _ in read_scalars(resumed.run_dir)["eval/loss"]] == [0, 2]


def hparam_scalars(run_dir):
    """The hparams record's ``hparam/`` scalars, timings left out (they differ between processes)."""
    timed = ("per_second", "peak_memory", "perf/")
    return {k: v for k, v in read_scalars(run_dir).items() if k.startswith("hparam/") and not any(t in k for t in timed)}


@pytest.mark.parametrize("extra", [[], ["train.eval_every=1", "train.keep_best=eval/loss", "train.early_stop_evals=1",
                                        "train.learning_rate=0.3"]], ids=["last-step", "early-stop"])
def test_a_run_resumed_where_it_ends_records_the_last_steps_metrics_in_hparams(tmp_path, extra):
    """A stop in the last step (or in the step whose evaluation stops the run early) saves before that
    evaluation; the resume evaluates and ends without training a step. Its hparams record held only the
    eval/ metrics: hparam/loss, hparam/grad_norm ... of the last step were missing."""
    from dtrain.run.trainer import Hooks

    whole, _ = run(tmp_path / "whole", "train.steps=4", *extra)
    last = whole.steps
    assert whole.early_stopped == bool(extra) and (last < 4) == bool(extra)

    def stop_in_last(step, run_):
        if step == last:
            run_.stop.requested = True

    run(tmp_path / "cut", "train.steps=4", *extra, hooks=Hooks(before_step=stop_in_last))
    resumed, _ = run(tmp_path / "cut", "train.steps=4", *extra, "train.resume=auto")
    assert resumed.history == [] and resumed.steps == last and resumed.early_stopped == whole.early_stopped
    expected = hparam_scalars(whole.run_dir)
    assert "hparam/loss" in expected and "hparam/eval/loss" in expected
    assert hparam_scalars(resumed.run_dir) == expected


@pytest.mark.parametrize("extra", [[], ["train.eval_every=1", "train.keep_best=eval/loss", "train.early_stop_evals=1",
                                        "train.learning_rate=0.3"]], ids=["last-step", "early-stop"])
def test_a_run_killed_after_its_last_checkpoint_keeps_its_hparams_record(tmp_path, monkeypatch, extra):
    """Killed while writing the adapter, after the checkpoint of its last step (or of the step that stopped it
    early): the resume only writes the adapter, and the run's hparams record, written after that checkpoint,
    was never written at all."""
    import dtrain.lora
    from dtrain.run import trainer

    whole, _ = run(tmp_path / "whole", "train.steps=4", *extra)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as mp:
        mp.setattr(trainer, "save_adapter", killed)
        mp.setattr(dtrain.lora, "save_adapter", killed)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path / "cut", "train.steps=4", *extra)
    resumed, _ = run(tmp_path / "cut", "train.steps=4", *extra, "train.resume=auto")
    assert resumed.history == [] and resumed.steps == whole.steps
    assert "hparam/loss" in hparam_scalars(whole.run_dir)
    assert hparam_scalars(resumed.run_dir) == hparam_scalars(whole.run_dir)


def non_finite_at(steps, crash_before=None):
    """Hooks whose engine gives non-finite gradients in ``steps``; ``crash_before``: step whose start
    raises (a process killed between steps, after the checkpoint of the step before)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    from dtrain.engine.common import StepResult
    from dtrain.run.trainer import Hooks

    current = {}

    def before_step(step, run_):
        if step == crash_before:
            raise KeyboardInterrupt("killed")
        current["step"] = step

    class Poisoned:
        def __init__(self, engine):
            self.engine, self.name, self.objective = engine, engine.name, engine.objective

        def step(self, chunk, totals, key=None, hyper=None):
            out = self.engine.step(chunk, totals, key, hyper)
            if current["step"] in steps:
                return StepResult(out.loss, out.sums, tree_map(lambda g: g * mx.nan, out.grads))
            return out

        def evaluate(self, chunk, totals, key=None, hyper=None):
            return self.engine.evaluate(chunk, totals, key, hyper)

    return Hooks(engine=Poisoned, before_step=before_step)


def test_a_streak_of_non_finite_steps_counts_across_a_resume(tmp_path):
    """train.max_skipped_steps 3, steps 3-5 non-finite: the run saves and stops after step 5. Killed
    after step 4 (checkpoint 4) and resumed, the streak started again at 0, so the resumed run trained
    on through a streak the uninterrupted run stopped at."""
    args = ("train.steps=8", "train.save_every=1", "train.max_skipped_steps=3", "train.eval_every=0")
    with pytest.raises(UserError, match=r"^step 5: 3 steps in a row had a non-finite loss or gradient"):
        run(tmp_path / "whole", *args, hooks=non_finite_at({3, 4, 5}))
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", *args, hooks=non_finite_at({3, 4, 5}, crash_before=5))
    with pytest.raises(UserError, match=r"^step 5: 3 steps in a row had a non-finite loss or gradient"):
        run(tmp_path / "cut", *args, "train.resume=auto", hooks=non_finite_at({3, 4, 5}))
    for out in ("whole", "cut"):
        state = json.loads((tmp_path / out / "checkpoints" / "step-0000005" / ckpt.STATE).read_text())
        assert state["skipped_steps"] == 3 and state["step"] == 5


def test_a_run_continued_from_an_older_checkpoint_drops_the_steps_it_left(tmp_path, capsys):
    """Resumed from step-0000004 of a run whose newest is step-0000006 (an accepted key changed), then
    stopped after step 5: resume=auto took the left branch's step 6 and ended there, without training
    step 6 on the new branch and with no step 6 in TensorBoard. The branch's first save removes the
    run's checkpoints past it."""
    from dtrain.run.trainer import Hooks

    args = ("train.steps=6", "train.eval_every=0", "train.save_every=1", "train.keep_last=3")
    first, _ = run(tmp_path, *args)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [
        "step-0000004", "step-0000005", "step-0000006"]

    def stop_in_5(step, run_):
        if step == 5:
            run_.stop.requested = True

    older = tmp_path / "checkpoints" / "step-0000004"
    capsys.readouterr()
    run(tmp_path, *args, f"train.resume={older}", "engine.kind=reference", hooks=Hooks(before_step=stop_in_5))
    assert ("resuming step-0000004: this run's later checkpoint(s) step-0000005, step-0000006 belong to the steps "
            "it leaves and are removed at its first save or its end (copy them elsewhere to keep them)") in capsys.readouterr().err
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-0000004", "step-0000005"]
    resumed, _ = run(tmp_path, *args, "train.resume=auto", "engine.kind=reference")
    assert len(resumed.history) == 1  # step 6, on the new branch
    assert [s for s, _ in read_scalars(resumed.run_dir)["loss"]] == [1, 2, 3, 4, 5, 6]


def test_a_branch_killed_right_after_its_first_save_is_the_one_resumed(tmp_path, monkeypatch):
    """Resumed from step-0000004 beside the left branch's step-0000005/6: killed after its first save (step 5)
    and before the prune that removes the left step 6, resume=auto took that step 6 and ended there, on the
    branch it had left. The steps left go before the save, so a kill anywhere leaves this branch newest."""
    from dtrain.run import trainer

    args = ("train.steps=6", "train.eval_every=0", "train.save_every=1", "train.keep_last=3")
    run(tmp_path, *args)
    older = tmp_path / "checkpoints" / "step-0000004"

    def killed(*_a, **_k):
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as mp:
        mp.setattr(trainer.ckpt, "prune", killed)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path, *args, f"train.resume={older}", "engine.kind=reference")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-0000004", "step-0000005"]
    resumed, _ = run(tmp_path, *args, "train.resume=auto", "engine.kind=reference")
    assert len(resumed.history) == 1  # step 6, on the new branch
    assert [s for s, _ in read_scalars(resumed.run_dir)["loss"]] == [1, 2, 3, 4, 5, 6]


def test_a_run_continued_from_an_older_checkpoint_at_its_end_drops_the_steps_it_left(tmp_path, capsys):
    """Resumed from step-0000004 with train.steps=4 (nothing left to train): the adapter was rewritten as step
    4's, but with no save the left branch's step-0000005/6 stayed, and resume=auto then took step 6 and
    stopped ("beyond train.steps=4"). The run's end removes them as a save would."""
    import mlx.core as mx

    from dtrain.lora import ADAPTER_WEIGHTS

    args = ("train.eval_every=2", "train.save_every=1", "train.keep_last=3")  # step 4's evaluation in its checkpoint
    run(tmp_path, "train.steps=6", *args)
    older = tmp_path / "checkpoints" / "step-0000004"
    capsys.readouterr()
    run(tmp_path, "train.steps=4", *args, f"train.resume={older}")
    assert "are removed at its first save or its end" in capsys.readouterr().err
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-0000004"]
    written, kept = (mx.load(str(d / ADAPTER_WEIGHTS)) for d in (tmp_path / "adapters", older))
    assert written.keys() == kept.keys() and all(mx.array_equal(written[k], kept[k]).item() for k in kept)
    resumed, _ = run(tmp_path, "train.steps=4", *args, "train.resume=auto")
    assert resumed.history == []


def write_rows(path, n=12, salt=""):
    words = "the quick brown fox jumps over lazy dog what is capital of france paris hello world".split()
    rows = [{"prompt": f"{words[i % 16]} {words[(i * 3) % 16]}?{salt}", "chosen": f"{words[(i + 5) % 16]} yes",
             "rejected": f"{words[(i + 7) % 16]} no"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_on_file(out, data, *overrides):
    from types import SimpleNamespace

    from conftest import make_tiny_model, make_tokenizer
    from dtrain.run.trainer import train

    cfg = load_config(None, [f"train.output_dir={out}", f"data.train={data}", "train.steps=2",
                             "train.global_batch_pairs=4", "train.micro_batch_pairs=4", "lora.rank=2",
                             "train.progress=false", "train.learning_rate=1e-2", *overrides])
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=make_tokenizer(), identity="tiny",
                             source="tiny-llama", reference={"path": "tiny-llama"})
    return train(cfg, loaded=loaded)


def test_the_same_data_file_at_a_moved_path_continues_the_run(tmp_path):
    data = tmp_path / "a" / "pairs.jsonl"
    data.parent.mkdir()
    write_rows(data)
    run_on_file(tmp_path / "out", data)
    moved = tmp_path / "b" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.move(data, moved)
    more = run_on_file(tmp_path / "out", moved, "train.steps=4", "train.resume=auto")
    assert len(more.history) == 2
    other = tmp_path / "c.jsonl"
    write_rows(other, salt=" again")
    with pytest.raises(UserError) as err:
        run_on_file(tmp_path / "out", other, "train.steps=6", "train.resume=auto")
    from dtrain.data.sources import sha256_file

    assert str(err.value).startswith(
        f"resume: {tmp_path}/out/checkpoints/step-0000004 was made with different settings: data content sha256 "
        f"(data.train, data.valid): {sha256_file(moved)!r} in the checkpoint, {sha256_file(other)!r} now; "
        f"training pairs sha256: ")


def test_a_refused_resume_computes_and_writes_nothing_first(tmp_path):
    """A DPO resume on other data was refused only after the new pairs had been cached and their
    reference pass (a forward of every pair: hours on a large set) had run and been cached too."""
    data, other, cache = tmp_path / "pairs.jsonl", tmp_path / "other.jsonl", tmp_path / "out" / "data_cache"
    write_rows(data)
    write_rows(other, salt=" again")
    run_on_file(tmp_path / "out", data, "objective.kind=dpo")
    before = sorted(p.name for p in cache.iterdir())
    assert len([n for n in before if n.startswith("reference-")]) == 2
    with pytest.raises(UserError, match=r"was made with different settings: data content sha256 \(data.train"):
        run_on_file(tmp_path / "out", other, "objective.kind=dpo", "train.steps=4", "train.resume=auto")
    assert sorted(p.name for p in cache.iterdir()) == before


def test_a_copied_run_folder_logs_into_its_own_tensorboard_run(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    args = ("train.eval_every=0", "train.save_every=2")
    first, _ = run(a, "train.steps=2", *args)
    state = json.loads((a / "checkpoints" / "step-0000002" / "state.json").read_text())
    assert state["tensorboard_run"] == str(first.run_dir.relative_to(a)) and state["tensorboard_run"].startswith("tb/")
    shutil.copytree(a, b)
    from dtrain.launch.restart import resume_point

    assert resume_point(b).tensorboard_dir == b / state["tensorboard_run"]  # where ./launch records restarts
    copied, _ = run(b, "train.steps=4", "train.resume=auto", *args)
    assert copied.run_dir == b / first.run_dir.relative_to(a)
    assert [s for s, _ in read_scalars(copied.run_dir)["loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in read_scalars(first.run_dir)["loss"]] == [1, 2]  # a's run is untouched
    shutil.move(b, c)
    moved, _ = run(c, "train.steps=6", "train.resume=auto", *args)
    assert moved.run_dir == c / first.run_dir.relative_to(a)
    assert [s for s, _ in read_scalars(moved.run_dir)["loss"]] == [1, 2, 3, 4, 5, 6]


def test_readme_lists_what_a_resume_refuses_and_compares_by_content():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("**What a resume accepts and refuses.**"): text.index("**Continuing a finished run.**")]
    refused = section[section.index("- refused"): section.index("- compared by content")]
    by_content = section[section.index("- compared by content"): section.index("- accepted")]
    assert [k for k in identity.REFUSED if f"`{k}`" not in refused] == []
    assert [k for k in identity.BY_CONTENT if f"`{k}`" not in by_content] == []
    accepted = section[section.index("- accepted"):]
    assert [k for k in identity.REFUSED if f"`{k}`" in accepted] == []


def test_warmup_continues_past_a_plan_shorter_than_it():
    """A run planned for 2 steps with 10 warmup steps, continued: warmup goes on, then the peak holds."""
    t = load_config(None, ["data.demo_pairs=1", "train.learning_rate=1e-3", "train.warmup_steps=10",
                           "train.schedule=cosine"]).train
    rates = [learning_rate(s, t, schedule_steps=2) for s in range(1, 14)]
    assert rates == pytest.approx([1e-3 * s / 10 for s in range(1, 11)] + [1e-3] * 3, rel=1e-12)


def test_the_extension_notice_says_what_the_rate_does():
    """The notice of a resume past the planned steps follows learning_rate: with warmup unfinished it
    says warmup continues (the 4-of-8 case with 10 warmup steps: 2.5e-4 ... 4e-4, then 5e-4), else it
    names the held final rate."""
    from dtrain.config import TrainConfig
    from dtrain.run.optimizer import extension_notice, learning_rate

    cfg = TrainConfig(steps=12, learning_rate=5e-4, warmup_steps=10, schedule="cosine")
    assert [learning_rate(s, cfg, 4) for s in (5, 8, 10, 11, 12)] == pytest.approx([2.5e-4, 4e-4, 5e-4, 5e-4, 5e-4])
    assert extension_notice(4, cfg, 4) == ("train.steps 12 is past the 4 steps this run's schedule was planned "
                                           "for: warmup continues to step 10, then steps 11-12 hold its final "
                                           "learning rate 0.0005")
    assert extension_notice(4, TrainConfig(steps=8, warmup_steps=10), 4).endswith("warmup continues to step 8, its last")
    done = TrainConfig(steps=24, learning_rate=2e-4, warmup_steps=0, schedule="linear", min_lr_ratio=0.1)
    assert extension_notice(12, done, 12) == ("train.steps 24 is past the 12 steps this run's schedule was planned "
                                              "for: steps 13-24 hold its final learning rate 2e-05")
    assert extension_notice(1, TrainConfig(steps=2, warmup_steps=0), 1).startswith(
        "train.steps 2 is past the 1 step this run's schedule was planned for: step 2 holds")


def test_the_notices_of_a_resume_that_changes_train_steps_by_one_step_or_to_fewer_steps():
    """One step past the plan is 'step 21 holds', not 'steps 21-21 hold'; a resume that ends before the
    planned steps (Ctrl-C at step 8 of 30, then train.steps 10) ended at the schedule's rate of step 10 without
    a word: it says so, with that rate and the planned final one (learning_rate at 10 and at 30)."""
    from dtrain.config import TrainConfig
    from dtrain.run.optimizer import extension_notice, learning_rate, shortened_notice

    one = TrainConfig(steps=21, learning_rate=2e-4, warmup_steps=0, schedule="constant")
    assert extension_notice(20, one, 20) == ("train.steps 21 is past the 20 steps this run's schedule was planned "
                                             "for: step 21 holds its final learning rate 0.0002")
    cfg = TrainConfig(steps=10, learning_rate=2e-4, warmup_steps=0, schedule="linear", min_lr_ratio=0.1)
    assert learning_rate(10, cfg, 30) == pytest.approx(1.4e-4)
    assert shortened_notice(cfg, 30) == ("train.steps 10 ends this run before the 30 steps its schedule was planned "
                                         "for: its last step trains at learning rate 0.00014, not the final 2e-05")
    assert shortened_notice(TrainConfig(steps=10, learning_rate=2e-4, schedule="constant"), 30) is None


def test_a_resume_to_fewer_steps_than_planned_says_where_the_rate_ends(tmp_path, capsys):
    """Stopped in step 3 of 8 (linear decay), resumed with train.steps 5: the notice names step 5's rate."""
    from dtrain.run.optimizer import learning_rate
    from dtrain.run.trainer import Hooks

    def stop_in_3(step, run_):
        if step == 3:
            run_.stop.requested = True

    args = ("train.steps=8", "train.eval_every=0", "train.schedule=linear", "train.warmup_steps=0",
            "train.learning_rate=1e-2")
    run(tmp_path, *args, hooks=Hooks(before_step=stop_in_3))
    capsys.readouterr()
    resumed, _ = run(tmp_path, *args, "train.steps=5", "train.resume=auto")
    assert len(resumed.history) == 2  # steps 4 and 5
    rate = learning_rate(5, load_config(None, ["data.demo_pairs=1", *args]).train, 8)
    assert (f"train.steps 5 ends this run before the 8 steps its schedule was planned for: its last step trains "
            f"at learning rate {rate:.3g}") in capsys.readouterr().err


def test_a_stop_during_an_evaluation_step_is_evaluated_on_resume(tmp_path):
    """A stop in step 4 (eval_every 2) saves before step 4's evaluation; the resume evaluates it first, so
    the adaptive λ and keep_best see the same evaluations as an uninterrupted run: the same adapters."""
    from dtrain.run.trainer import Hooks

    def stop_in_4(step, run_):
        if step == 4:
            run_.stop.requested = True

    args = ("train.steps=6", "orpo.lambda_schedule=adaptive", "orpo.lambda_epsilon=5", "orpo.lambda_step=0.1",
            "train.keep_best=eval/log_odds_ratio")
    whole, _ = run(tmp_path / "whole", *args)
    stopped, _ = run(tmp_path / "cut", *args, hooks=Hooks(before_step=stop_in_4))
    assert stopped.stopped and stopped.steps == 4 and sorted(stopped.evals) == [0, 2]
    resumed, _ = run(tmp_path / "cut", *args, "train.resume=auto")
    assert sorted(whole.evals) == sorted(resumed.evals) == [0, 2, 4, 6]
    assert resumed.evals == whole.evals
    lambdas = [h["train/lambda"] for h in whole.history]
    assert len(set(lambdas)) > 1 and [h["train/lambda"] for h in stopped.history + resumed.history] == lambdas
    assert [s for s, _ in read_scalars(resumed.run_dir)["eval/loss"]] == [0, 2, 4, 6]
    for folder in ("adapters", "adapters-last"):
        a, b = ((tmp_path / r / folder / "adapters.safetensors").read_bytes() for r in ("whole", "cut"))
        assert a == b, folder


def run_on(tmp_path, folder, *overrides):
    """A 16-pair demo run on the model folder ``folder`` into ``tmp_path/out`` (float32)."""
    from dtrain.models import load_model
    from dtrain.run.trainer import train

    cfg = load_config(None, [f"model.path={folder}", f"train.output_dir={tmp_path / 'out'}", "data.demo_pairs=16",
                             "data.max_length=64", "data.max_prompt_length=32", "lora.rank=2",
                             "train.global_batch_pairs=4", "train.micro_batch_pairs=4", "train.progress=false",
                             *overrides])
    return train(cfg, loaded=load_model(str(folder), "float32"))


def test_a_model_folder_is_compared_by_content_on_resume(tmp_path):
    """A moved copy of the base model folder continues the run; other weights of the same shapes
    in the same folder are refused, naming model.path."""
    from conftest import make_tiny_model
    from fixtures_launch import make_model_folder
    from mlx_lm.utils import save_model

    from dtrain.models import load_model

    model = make_model_folder(tmp_path / "model")
    run_on(tmp_path, model, "train.steps=2")
    moved = tmp_path / "elsewhere" / "model"
    shutil.move(model, moved)
    assert len(run_on(tmp_path, moved, "train.steps=4", "train.resume=auto").history) == 2
    before = load_model(str(moved), "float32").identity
    save_model(moved, make_tiny_model(seed=7, num_hidden_layers=2))  # same names and shapes, other weights
    with pytest.raises(UserError) as err:
        run_on(tmp_path, moved, "train.steps=6", "train.resume=auto")
    now = load_model(str(moved), "float32").identity
    assert before != now and str(err.value) == (
        f"resume: {tmp_path}/out/checkpoints/step-0000004 was made with different settings: model.path: "
        f"{before!r} in the checkpoint, {now!r} now. {ckpt.RESUME_HINT}")


def test_a_checkpoint_of_an_earlier_version_resumes_on_its_model_folder(tmp_path):
    """Checkpoints written before folder identities were by content hold ``mlx-lm:<path>:<config hash>``
    (``LoadedModel.aliases``): the same folder at that path continues them and keeps that identity; the
    folder moved elsewhere is refused, as it was then."""
    import hashlib

    from fixtures_launch import make_model_folder

    from dtrain.files import sha256_file
    from dtrain.models import load_model

    model = make_model_folder(tmp_path / "model")
    run_on(tmp_path, model, "train.steps=2")
    loaded = load_model(str(model), "float32")
    (legacy,) = loaded.aliases
    config_hash = hashlib.sha256(repr(sorted(loaded.config.items())).encode()).hexdigest()[:16]
    assert legacy == f"mlx-lm:{model.resolve()}:{config_hash}" and loaded.identity.startswith("mlx-lm-folder:")
    step2 = tmp_path / "out" / "checkpoints" / "step-0000002"
    state = json.loads((step2 / ckpt.STATE).read_text())
    state["model"] = legacy  # as dtrain before 2026-12-04 wrote it
    (step2 / ckpt.STATE).write_text(json.dumps(state, indent=2))
    manifest = json.loads((step2 / ckpt.MANIFEST).read_text())
    manifest["files"][ckpt.STATE] = {"sha256": sha256_file(step2 / ckpt.STATE), "bytes": (step2 / ckpt.STATE).stat().st_size}
    (step2 / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert ckpt.validate(step2) is None
    assert len(run_on(tmp_path, model, "train.steps=4", "train.resume=auto").history) == 2
    assert json.loads((tmp_path / "out" / "checkpoints" / "step-0000004" / ckpt.STATE).read_text())["model"] == legacy
    moved = tmp_path / "elsewhere" / "model"
    shutil.move(model, moved)
    with pytest.raises(UserError, match="model.path: 'mlx-lm:"):
        run_on(tmp_path, moved, "train.steps=6", "train.resume=auto")


@pytest.mark.parametrize("product, resumes", [("float32", True), ("bfloat16", False)])
def test_a_checkpoint_from_before_a_key_compares_as_the_value_it_ran_with(tmp_path, product, resumes):
    """A checkpoint written before ``lora.branch_dtype`` existed lacks it and ran mlx-lm's float32
    product (``identity.BEFORE_KEY``): a run whose product is float32 continues it; a bfloat16 product
    is refused naming the key and both values (``--lora.branch_dtype float32`` continues it as it was)."""
    old = to_dict(Config())
    saved = state_for(old)
    del saved.settings["lora.branch_dtype"]
    now = json.loads(json.dumps(old))
    now["lora"]["branch_dtype"] = product
    if resumes:
        ckpt.check_resumable(saved, state_for(now), [1, 2], tmp_path)
        return
    with pytest.raises(UserError) as err:
        ckpt.check_resumable(saved, state_for(now), [1, 2], tmp_path)
    assert str(err.value) == (f"resume: {tmp_path} was made with different settings: lora.branch_dtype: 'float32' in "
                              f"the checkpoint, 'bfloat16' now. {ckpt.RESUME_HINT}")


def test_auto_resolves_the_lora_product_from_the_models_dtype():
    """``lora.branch_dtype: auto`` is resolved once at setup from ``model.dtype`` (``device.resolve_auto``),
    so the run's settings and checkpoints record the product it computes."""
    from dtrain.device import resolve_auto

    for dtype, product in (("float32", "float32"), ("float16", "float32"), ("bfloat16", "bfloat16")):
        cfg, choices = resolve_auto(load_config(None, [f"model.dtype={dtype}", "data.demo_pairs=4"]))
        assert cfg.lora.branch_dtype == choices["lora.branch_dtype"] == product
    cfg, choices = resolve_auto(load_config(None, ["lora.branch_dtype=float32", "model.dtype=bfloat16",
                                                   "data.demo_pairs=4"]))
    assert cfg.lora.branch_dtype == "float32" and "lora.branch_dtype" not in choices


@pytest.mark.parametrize("overrides, refused", [
    (["orpo.lambda_schedule=adaptive"], True),
    (["train.keep_best=eval/loss"], True),
    (["objective.kind=dpo"], False),
    ([], False),
])
def test_eval_every_is_refused_where_it_decides_what_is_trained(tmp_path, overrides, refused):
    run(tmp_path, "train.steps=2", *overrides)
    if refused:
        with pytest.raises(UserError) as err:
            run(tmp_path, "train.steps=4", "train.resume=auto", "train.eval_every=1", *overrides)
        assert str(err.value) == (f"resume: {tmp_path}/checkpoints/step-0000002 was made with different settings: "
                                  f"train.eval_every: 2 in the checkpoint, 1 now (with an adaptive λ schedule or "
                                  f"train.keep_best it decides when λ changes and which steps are compared). "
                                  f"{ckpt.RESUME_HINT}")
    else:
        more, _ = run(tmp_path, "train.steps=4", "train.resume=auto", "train.eval_every=1", *overrides)
        assert len(more.history) == 2


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_micro_batch_pairs_is_refused_with_lora_dropout(tmp_path, dropout):
    """Dropout masks are drawn per micro-batch: with lora.dropout > 0 another train.micro_batch_pairs trains
    another adapter, yet a resume accepted it."""
    run(tmp_path, "train.steps=2", f"lora.dropout={dropout}")
    args = ("train.steps=4", "train.resume=auto", f"lora.dropout={dropout}", "train.micro_batch_pairs=2")
    if dropout:
        with pytest.raises(UserError) as err:
            run(tmp_path, *args)
        assert str(err.value) == (f"resume: {tmp_path}/checkpoints/step-0000002 was made with different settings: "
                                  f"train.micro_batch_pairs: 4 in the checkpoint, 2 now (with lora.dropout above 0 it "
                                  f"decides the dropout masks, drawn per micro-batch). {ckpt.RESUME_HINT}")
    else:
        more, _ = run(tmp_path, *args)
        assert len(more.history) == 2


def test_a_checkpoint_without_a_conditional_key_continues(tmp_path):
    resolved = to_dict(load_config(None, ["orpo.lambda_schedule=adaptive", "train.eval_every=50", "data.demo_pairs=1"]))
    current = state_for(resolved)
    assert current.settings["train.eval_every"] == resolved["train"]["eval_every"]
    saved = state_for(resolved)
    del saved.settings["train.eval_every"]  # written before the rule
    ckpt.check_resumable(saved, current, [1, 2], tmp_path)
    saved.settings["train.eval_every"] = resolved["train"]["eval_every"] + 1
    with pytest.raises(UserError, match=r"train\.eval_every: 51 in the checkpoint, 50 now"):
        ckpt.check_resumable(saved, current, [1, 2], tmp_path)


def test_a_checkpoint_that_recorded_the_init_adapter_by_its_path_still_continues(tmp_path):
    """Checkpoints from before train.init_adapter was compared by its weights hold it in ``settings``
    (by its path): one without an initial adapter continues a run without one, and refuses one with."""
    from pathlib import Path

    run(tmp_path, "train.steps=2")
    saved = ckpt.load_checkpoint(tmp_path / "checkpoints" / "step-0000002").state
    assert saved.init_adapter is None and "train.init_adapter" not in saved.settings
    older = dataclasses.replace(saved, settings={**saved.settings, "train.init_adapter": None})
    ckpt.check_resumable(older, saved, saved.position["next_pairs"], Path("step-0000002"))
    with pytest.raises(UserError, match="train.init_adapter: None in the checkpoint, 'abab"):
        ckpt.check_resumable(older, dataclasses.replace(saved, init_adapter="ab" * 32), saved.position["next_pairs"],
                             Path("step-0000002"))


def test_resume_auto_with_no_checkpoint_says_the_run_starts_anew(tmp_path, capsys):
    """A mistyped train.output_dir under --train.resume auto trained from step 1 without a word."""
    result, _ = run(tmp_path / "new", "train.steps=1", "train.resume=auto")
    assert result.steps == 1
    assert f"train.resume auto: no checkpoint in {tmp_path / 'new' / 'checkpoints'}; this run starts at step 1" in (
        capsys.readouterr().err)


def test_resuming_a_run_extended_to_its_end_names_no_steps_to_come(tmp_path, capsys):
    """A finished run extended past its schedule, resumed again at its end, said "steps 4-3 hold its final
    learning rate" and "resumed ... at step 4" with train.steps 3: nothing is left to train."""
    run(tmp_path, "train.steps=2")
    run(tmp_path, "train.steps=3", "train.resume=auto")
    capsys.readouterr()
    again, _ = run(tmp_path, "train.steps=3", "train.resume=auto")
    err = capsys.readouterr().err
    assert again.history == [] and "is past the" not in err
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-0000003'} after its last step, 3" in err


@pytest.mark.parametrize("during", [0, 2])
def test_a_signal_during_an_evaluation_stops_it_and_the_resume_matches(tmp_path, capsys, during):
    """Ctrl-C during the evaluation at step ``during`` cuts it short (its first of 3 micro-batches run), keeps
    none of it and saves, without training another step (it finished the evaluation and trained one more
    step: on a CPU, minutes); the resume evaluates that step first and gives the uninterrupted run's adapter.
    Stopped in step 0's evaluation, its checkpoint step-0000000 was refused as damaged ("step is 0, below 1"):
    the resume skipped it and started another run, in a second TensorBoard run."""
    import os
    import signal

    from dtrain.run.trainer import Hooks

    class SignalInEval:
        """Sends this process SIGINT from inside the evaluation at step ``during`` (3 micro-batches each)."""

        def __init__(self, engine):
            self.engine, self.objective, self.name, self.evals = engine, engine.objective, engine.name, 0

        def step(self, *args):
            return self.engine.step(*args)

        def evaluate(self, *args):
            if self.evals == 3 * (during // 2):
                os.kill(os.getpid(), signal.SIGINT)
            self.evals += 1
            return self.engine.evaluate(*args)

    micro = ("train.micro_batch_pairs=1",)
    whole, _ = run(tmp_path / "whole", *micro)
    wrapped = []
    stopped, _ = run(tmp_path / "cut", *micro, hooks=Hooks(engine=lambda e: wrapped.append(SignalInEval(e)) or wrapped[0]))
    assert wrapped[0].evals == 3 * (during // 2) + 1  # the rest of that evaluation was skipped
    assert stopped.stopped and stopped.steps == during and len(stopped.history) == during
    assert sorted(stopped.evals) == list(range(0, during, 2))
    assert ckpt.list_checkpoints(tmp_path / "cut" / "checkpoints")[-1].name == f"step-{during:07d}"
    capsys.readouterr()
    resumed, _ = run(tmp_path / "cut", *micro, "train.resume=auto")
    assert "skipping checkpoint" not in capsys.readouterr().err
    assert resumed.run_dir == stopped.run_dir and len(list((tmp_path / "cut" / "tb").iterdir())) == 1
    assert len(resumed.history) == 4 - during and resumed.evals == whole.evals
    assert [s for s, _ in read_scalars(resumed.run_dir)["eval/loss"]] == [0, 2, 4]
    a, b = ((tmp_path / r / "adapters" / "adapters.safetensors").read_bytes() for r in ("whole", "cut"))
    assert a == b


@pytest.mark.parametrize("first, then", [
    (["orpo.lambda_max=0.3"], []),  # static: the controller's keys are unread
    (["train.schedule=constant", "train.min_lr_ratio=0.5"], ["train.schedule=constant"]),
    (["orpo.lambda_schedule=adaptive", "orpo.lambda=0.2"], ["orpo.lambda_schedule=adaptive"]),
    (["orpo.lambda_schedule=adaptive", "orpo.lambda_kd=1.0"], ["orpo.lambda_schedule=adaptive"]),  # aimd
])
def test_a_key_the_run_does_not_read_may_change_on_resume(tmp_path, first, then):
    """The first run's notice says the key has no effect ('orpo.lambda_max' is 0.3 but orpo.lambda_schedule static
    does not read it); removed on the resume, it was refused as a setting that decides what is trained."""
    run(tmp_path, "train.steps=2", *first)
    more, _ = run(tmp_path, "train.steps=4", "train.resume=auto", *then)
    assert len(more.history) == 2


def test_a_checkpoint_that_recorded_an_unread_key_continues():
    """Checkpoints written before unread keys were left out of the settings hold them (every orpo.lambda_* of a
    static run): a resume, which records none of them, continues, and a key the run does read is still compared."""
    resolved = to_dict(Config())
    recorded = {key: resolved[key.split(".", 1)[0]][key.split(".", 1)[1]] for key in identity.REFUSED}
    ckpt.check_resumable(dataclasses.replace(state_for(resolved), settings=recorded), state_for(resolved), [1, 2],
                         "ckpt")
    with pytest.raises(UserError, match=r"settings: orpo.lambda: 0.2 in the checkpoint, 0.1 now\. "):
        ckpt.check_resumable(dataclasses.replace(state_for(resolved), settings={**recorded, "orpo.lambda": 0.2}),
                             state_for(resolved), [1, 2], "ckpt")


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_a_resume_at_another_world_size_with_lora_dropout_says_the_masks_differ(tmp_path, capsys, dropout):
    """A resume may change the world size, but with LoRA dropout each rank draws masks from a key of its own
    (step.dropout_key), so the run then trains another adapter than the uninterrupted one (README: Checkpoints
    and resume); the run said nothing, while a changed train.micro_batch_pairs, which changes the masks the same
    way, is refused. Here the checkpoint is made a world size 2 one (its state.json and manifest rewritten)."""
    import hashlib

    from dtrain.run.trainer import Hooks

    def stop_in_2(step, run_):
        if step == 2:
            run_.stop.requested = True

    args = ("train.steps=4", "train.eval_every=0", f"lora.dropout={dropout}")
    run(tmp_path, *args, hooks=Hooks(before_step=stop_in_2))
    saved = ckpt.find_latest(tmp_path / "checkpoints")
    state = json.loads((saved / ckpt.STATE).read_text())
    (saved / ckpt.STATE).write_text(json.dumps({**state, "world_size": 2}, indent=2))
    manifest = json.loads((saved / ckpt.MANIFEST).read_text())
    data = (saved / ckpt.STATE).read_bytes()
    manifest["files"][ckpt.STATE] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (saved / ckpt.MANIFEST).write_text(json.dumps(manifest, indent=2))
    capsys.readouterr()
    run(tmp_path, *args, "train.resume=auto")
    notice = ("resumed at world size 1 from step 2, trained at world size 2: with lora.dropout 0.1 each rank draws "
              "its own dropout masks, so from step 3 the adapter differs from an uninterrupted run at world size 2 "
              "(the same pairs are trained)")
    assert (notice in capsys.readouterr().err) == (dropout > 0)



class Crash(Exception):
    pass


def stop_in_step_0(engine):
    """The engine, its evaluations sending this process SIGINT: the evaluation at step 0 comes before any step."""
    evaluate = engine.evaluate
    engine.evaluate = lambda *args: (os.kill(os.getpid(), signal.SIGINT), evaluate(*args))[1]
    return engine


@pytest.mark.parametrize("cut", [0, 2])
def test_a_resumed_evaluation_is_logged_once_when_the_resume_is_cut_again(tmp_path, cut):
    """Stopped in the evaluation at step ``cut`` (a stop agreed there saves before it), resumed (which evaluates
    step ``cut`` first), then killed in step 4 before any later save: the next resume continued the same
    checkpoint and evaluated step ``cut`` again, and TensorBoard showed that evaluation twice (the START of
    a resume drops what the run logged after its checkpoint's step, not at it)."""
    from dtrain.run.trainer import Hooks
    from test_trainer import tensorboard_scalars

    def stop(step, run_):  # after step ``cut``'s update: agreed in its evaluation
        if step == cut:
            run_.stop.requested = True

    def crash_in_4(step, run_):
        if step == 4:
            raise Crash

    whole, _ = run(tmp_path / "whole")
    stopped, _ = run(tmp_path / "cut", hooks=Hooks(engine=stop_in_step_0) if cut == 0 else Hooks(after_step=stop))
    assert stopped.stopped and stopped.steps == cut and cut not in stopped.evals
    with pytest.raises(Crash):
        run(tmp_path / "cut", "train.resume=auto", hooks=Hooks(before_step=crash_in_4))
    resumed, _ = run(tmp_path / "cut", "train.resume=auto")
    shown = tensorboard_scalars(resumed.run_dir)
    assert shown["eval/loss"] == tensorboard_scalars(whole.run_dir)["eval/loss"]
    assert [s for s, _ in shown["eval/loss"]] == [0, 2, 4] and [s for s, _ in shown["loss"]] == [1, 2, 3, 4]
    assert read_scalars(resumed.run_dir)["eval/loss"] == shown["eval/loss"]


@pytest.mark.parametrize("cut", [0, 2, 4])
def test_a_resume_cut_while_it_saves_its_checkpoints_step_again_logs_that_step_once(tmp_path, monkeypatch, cut):
    """Stopped in step ``cut`` (or in step 0's evaluation), saved before that step's evaluation; the resume
    evaluates it (at step 4, the run's last: and writes the run's end record) and is killed while it saves
    checkpoint ``cut`` again. The next resume continued the old checkpoint ``cut`` and logged that evaluation
    again: TensorBoard showed eval/loss at step ``cut`` twice (and hparam/loss at step 4), since the START of a
    resume dropped only what came after the checkpoint's step."""
    from dtrain.run.trainer import Hooks
    from test_trainer import tensorboard_scalars

    def stop(step, run_):
        if step == cut:
            run_.stop.requested = True

    def killed(*args, **kwargs):
        raise Crash

    whole, _ = run(tmp_path / "whole")
    stopped, _ = run(tmp_path / "cut", hooks=Hooks(engine=stop_in_step_0) if cut == 0 else Hooks(before_step=stop))
    assert stopped.stopped and stopped.steps == cut and cut not in stopped.evals
    with monkeypatch.context() as mp:
        mp.setattr(ckpt, "save_checkpoint", killed)
        with pytest.raises(Crash):
            run(tmp_path / "cut", "train.resume=auto")
    resumed, _ = run(tmp_path / "cut", "train.resume=auto")
    shown, expected = tensorboard_scalars(resumed.run_dir), tensorboard_scalars(whole.run_dir)
    timed = ("per_second", "peak_memory", "perf/")
    assert {k: v for k, v in shown.items() if not any(t in k for t in timed)} == {
        k: v for k, v in expected.items() if not any(t in k for t in timed)}
    assert [s for s, _ in shown["eval/loss"]] == [0, 2, 4] and [s for s, _ in shown["loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in shown["tokens_per_second"]] == [1, 2, 3, 4]
    assert read_scalars(resumed.run_dir)["eval/loss"] == shown["eval/loss"]


@pytest.mark.parametrize("override, was, now", [("engine.kind=reference", "'segmented'", "'reference'"),
                                                ("engine.prefix_sharing=false", "True", "False"),
                                                ("engine.pack=false", "True", "False"),
                                                ("engine.length_bucket=16", "0", "16")])  # auto's, CPU
def test_engine_keys_that_lay_out_the_rows_are_refused_with_lora_dropout(tmp_path, override, was, now):
    """The dropout masks are drawn over a micro-batch's rows, which these keys lay out: with lora.dropout 0.1 a
    4-step run under each trains another adapter (by about 1e-2, not float rounding), yet a resume accepted them
    as "how the same gradients are computed"."""
    from mlx.core import abs as mx_abs, load

    def adapter(out):
        return load(str(out / "adapters" / "adapters.safetensors"))

    run(tmp_path / "auto", "lora.dropout=0.1")
    run(tmp_path / "other", "lora.dropout=0.1", override)
    a, b = adapter(tmp_path / "auto"), adapter(tmp_path / "other")
    assert max(mx_abs(a[k] - b[k]).max().item() for k in a) > 1e-3
    run(tmp_path / "cut", "train.steps=2", "lora.dropout=0.1")
    with pytest.raises(UserError) as err:
        run(tmp_path / "cut", "train.resume=auto", "lora.dropout=0.1", override)
    assert str(err.value) == (f"resume: {tmp_path}/cut/checkpoints/step-0000002 was made with different settings: "
                              f"{override.split('=')[0]}: {was} in the checkpoint, {now} now "
                              f"(with lora.dropout above 0 it decides the dropout masks, drawn over the micro-batch's "
                              f"rows). {ckpt.RESUME_HINT}")
    run(tmp_path / "plain", "train.steps=2")
    more, _ = run(tmp_path / "plain", "train.resume=auto", override)  # no dropout: the same gradients
    assert len(more.history) == 2


def on_device(monkeypatch, gpu: bool) -> None:
    """Resolve ``auto`` as on a GPU (a Mac, CUDA) or on the CPU: MLX's default device as dtrain asks it."""
    import dtrain.device as device
    import dtrain.models.load as load

    monkeypatch.setattr(device, "on_gpu", lambda: gpu)
    monkeypatch.setattr(load, "on_gpu", lambda: gpu)


def test_model_dtype_auto_is_compared_by_the_dtype_it_chose(tmp_path, monkeypatch):
    """``model.dtype: auto`` is float32 on the CPU, bfloat16 on a GPU. A checkpoint recorded the word ``auto``: an
    explicit float32 resuming a CPU run was refused, and a GPU's resume named ``lora.branch_dtype``, whose hint
    (``--lora.branch_dtype float32``) was accepted and trained on with the model in bfloat16."""
    on_device(monkeypatch, gpu=False)
    run(tmp_path, "train.steps=2")
    more, _ = run(tmp_path, "train.steps=3", "train.resume=auto", "model.dtype=float32")  # what auto computed in
    assert len(more.history) == 1
    step3 = tmp_path / "checkpoints" / "step-0000003"
    assert json.loads((step3 / ckpt.STATE).read_text())["settings"]["model.dtype"] == "float32"
    on_device(monkeypatch, gpu=True)
    for given in ([], ["lora.branch_dtype=float32"]):  # lora.branch_dtype auto follows model.dtype: not named
        with pytest.raises(UserError) as err:
            run(tmp_path, "train.steps=4", "train.resume=auto", "train.compile_optimizer=false", *given)
        assert str(err.value) == (f"resume: {step3} was made with different settings: model.dtype: 'float32' in the "
                                  f"checkpoint, 'bfloat16' now (auto on this device). {ckpt.RESUME_HINT}")
    more, _ = run(tmp_path, "train.steps=4", "train.resume=auto", "train.compile_optimizer=false",
                  "model.dtype=float32")
    assert len(more.history) == 1


def test_the_rows_auto_laid_out_are_compared_by_its_choice_with_lora_dropout(tmp_path, monkeypatch):
    """With lora.dropout above 0, ``engine.length_bucket`` and ``engine.kind`` lay out the rows the masks cover. Their
    ``auto`` (0 on the CPU, 128 on a GPU; the segmented engine) was recorded as the word: the explicit values it
    chose, which train the same adapter bit for bit, were refused, and a GPU's 128 was accepted."""
    from mlx.core import load

    on_device(monkeypatch, gpu=False)
    args = ("lora.dropout=0.1", "train.save_every=2", "train.compile_optimizer=false")
    run(tmp_path / "whole", *args)
    whole = load(str(tmp_path / "whole" / "adapters" / "adapters.safetensors"))
    step2 = tmp_path / "whole" / "checkpoints" / "step-0000002"
    run(tmp_path / "whole", *args, f"train.resume={step2}", "engine.length_bucket=0", "engine.kind=segmented")
    again = load(str(tmp_path / "whole" / "adapters" / "adapters.safetensors"))
    assert all((whole[k] == again[k]).all().item() for k in whole)
    on_device(monkeypatch, gpu=True)
    with pytest.raises(UserError) as err:
        run(tmp_path / "whole", *args, f"train.resume={step2}", "model.dtype=float32")
    assert str(err.value) == (f"resume: {step2} was made with different settings: engine.length_bucket: 0 in the "
                              f"checkpoint, 128 now (auto on this device; with lora.dropout above 0 it decides the "
                              f"dropout masks, drawn over the micro-batch's rows). {ckpt.RESUME_HINT}")


def test_a_checkpoint_that_recorded_auto_compares_the_word(tmp_path, monkeypatch):
    """Checkpoints from before the choice was recorded hold the word ``auto`` (model.dtype; with lora dropout also
    engine.length_bucket and engine.kind): which device chose is unknown, so the word is compared with this run's,
    as before; engine.kind's ``auto`` was the segmented engine's rows on every device, so ``segmented`` continues it."""
    from dtrain.device import resolve_auto

    on_device(monkeypatch, gpu=False)

    def current(*overrides):  # (this run's settings, as its config spells them), as trainer.setup makes them
        given = load_config(None, ["lora.dropout=0.1", "data.demo_pairs=1", *overrides])
        return state_for(to_dict(resolve_auto(given)[0])), identity.settings(to_dict(given))

    saved = state_for(to_dict(load_config(None, ["lora.dropout=0.1", "data.demo_pairs=1"])))
    saved.settings.update({"model.dtype": "auto", "engine.length_bucket": "auto", "engine.kind": "auto"})
    for overrides in ([], ["engine.kind=segmented"]):
        state, spelled = current(*overrides)
        ckpt.check_resumable(saved, state, [1, 2], tmp_path, spelled=spelled)
    for override, was, now in (("model.dtype=float32", "'auto'", "'float32'"),
                               ("engine.length_bucket=0", "'auto'", "0")):
        state, spelled = current(override)
        with pytest.raises(UserError) as err:
            ckpt.check_resumable(saved, state, [1, 2], tmp_path, spelled=spelled)
        assert str(err.value) == (f"resume: {tmp_path} was made with different settings: {override.split('=')[0]}: "
                                  f"{was} in the checkpoint, {now} now"
                                  + (" (with lora.dropout above 0 it decides the dropout masks, drawn over the "
                                     "micro-batch's rows)" if "engine" in override else "") + f". {ckpt.RESUME_HINT}")


def test_a_checkpoint_split_by_row_is_refused_naming_the_split_where_prompts_repeat(tmp_path):
    """data.valid_fraction holds out whole prompts (data.split_rows): where prompts repeat, a checkpoint of an
    earlier dtrain trained on another split, refused by its pairs' sha256 alone (the data file unchanged). The run
    records the split where it matters; such a checkpoint lacks it and compares as split by row."""
    old = to_dict(Config())
    saved, current = state_for(old), state_for(old)
    current.data = {"held-out split": "by prompt", **saved.data}
    with pytest.raises(UserError) as err:
        ckpt.check_resumable(saved, current, [1, 2], tmp_path)
    assert str(err.value) == (f"resume: {tmp_path} was made with different settings: held-out split: 'by row (an "
                              f"earlier dtrain)' in the checkpoint, 'by prompt' now. {ckpt.RESUME_HINT}")
    saved.data = dict(current.data)
    ckpt.check_resumable(saved, current, [1, 2], tmp_path)
    assert ckpt.data_identity("fp", [], [], by_prompt=True)["held-out split"] == "by prompt"
    assert "held-out split" not in ckpt.data_identity("fp", [], [])  # unique prompts: the split of before


def test_a_stop_agreed_in_an_evaluation_is_marked_agreed_as_one_agreed_after_a_step(tmp_path):
    """``StopRequest.agreed`` (read as the handlers are restored: a rank whose own stop signal is still on its
    way swallows it) was set only where a step's all-reduce agreed on the stop; one agreed in an evaluation's
    left it False, so that signal could end a rank that had saved, as a failed one."""
    from dtrain.run.trainer import Hooks

    runs = []

    class StopInEval:
        def __init__(self, engine):
            self.engine, self.objective, self.name = engine, engine.objective, engine.name

        def step(self, *args):
            return self.engine.step(*args)

        def evaluate(self, *args):
            if runs:  # step 2's evaluation: the flag this evaluation all-reduces is set
                runs[0].stop.requested = True
            return self.engine.evaluate(*args)

    stopped, _ = run(tmp_path, hooks=Hooks(engine=StopInEval, before_step=lambda step, r: runs.append(r)))
    assert stopped.stopped and stopped.steps == 2
    assert runs[0].stop.agreed


@pytest.mark.parametrize("kind, default", [("dpo", 0.1), ("simpo", 2.0)])
def test_objective_beta_null_is_compared_as_the_beta_it_trains_with(kind, default):
    """``objective.beta: null`` trains with the kind's default (docs/objectives.md: 0.1 for dpo, 2.0 for simpo): a
    resume that writes that value out, or a checkpoint of it resumed with null, was refused (``objective.beta: None in
    the checkpoint, 0.1 now``); another beta is still refused."""
    def state(beta):
        resolved = to_dict(load_config(None, ["data.demo_pairs=1", f"objective.kind={kind}", f"objective.beta={beta}"]))
        return state_for(resolved)

    ckpt.check_resumable(state("null"), state(default), [1, 2], "ckpt")
    ckpt.check_resumable(state(default), state("null"), [1, 2], "ckpt")
    with pytest.raises(UserError, match=rf"settings: objective.beta: {default} in the checkpoint, {default * 2} now\. "):
        ckpt.check_resumable(state("null"), state(default * 2), [1, 2], "ckpt")


def run_dated(out, data, *overrides):
    """:func:`run_on_file` with a Llama 3.2-style tokenizer, whose template writes today's date."""
    from types import SimpleNamespace

    from chat_fixtures import style_tokenizer
    from conftest import make_tiny_model
    from dtrain.run.trainer import train

    cfg = load_config(None, [f"train.output_dir={out}", f"data.train={data}", "train.global_batch_pairs=4",
                             "train.micro_batch_pairs=4", "lora.rank=2", "train.progress=false",
                             "train.learning_rate=1e-2", *overrides])
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0, vocab_size=600),
                             tokenizer=style_tokenizer("llama32"), identity="tiny", source="tiny-llama",
                             reference={"path": "tiny-llama"})
    return train(cfg, loaded=loaded)


def test_a_run_renders_the_day_it_started_on_resume_after_its_data_cache_is_deleted(tmp_path, monkeypatch, capsys):
    """A run on a template that writes today's date (Llama 3.2), resumed the next day with its data_cache
    deleted (README: delete it to free space), was refused: its pairs, rendered with the new day, had other ids.
    The run fixes the day when it starts, its checkpoints record it, and the resume renders it again: the
    adapter is the uninterrupted run's, bit for bit."""
    from chat_fixtures import fake_day

    data = tmp_path / "pairs.jsonl"
    write_rows(data)
    fake_day(monkeypatch, "2026-03-01")
    run_dated(tmp_path / "whole", data, "train.steps=4")
    run_dated(tmp_path / "cut", data, "train.steps=2")
    said = ("the model's chat template writes the date into every conversation: rendered with 01 Mar 2026 "
            "(data.template_date 2026-03-01)")
    assert capsys.readouterr().err.count(said) == 2
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-0000002" / "state.json").read_text())
    assert state["settings"]["data.template_date"] == "2026-03-01"
    shutil.rmtree(tmp_path / "cut" / "data_cache")
    fake_day(monkeypatch, "2026-03-02")
    more = run_dated(tmp_path / "cut", data, "train.steps=4", "train.resume=auto")
    assert len(more.history) == 2 and capsys.readouterr().err.count(said) == 1
    a, b = ((tmp_path / r / "adapters" / "adapters.safetensors").read_bytes() for r in ("whole", "cut"))
    assert a == b
    with pytest.raises(UserError) as err:  # another day, set: another rendering of the pairs
        run_dated(tmp_path / "cut", data, "train.steps=6", "train.resume=auto", "data.template_date=2026-03-02")
    assert str(err.value).startswith(
        f"resume: {tmp_path}/cut/checkpoints/step-0000004 was made with different settings: data.template_date: "
        "'2026-03-01' in the checkpoint, '2026-03-02' now (the day a chat template that writes today's date (Llama "
        "3.2's) renders into every pair).")


def test_every_rank_renders_rank_0s_day(tmp_path, monkeypatch):
    """Ranks on either side of midnight (or in other time zones) rendered other dates, so the handshake refused
    the run ('data differs'): a rank takes rank 0's day, not its own clock's."""
    from types import SimpleNamespace

    from chat_fixtures import fake_day
    from dtrain.run.trainer import run_template_date

    fake_day(monkeypatch, "2026-03-02")
    sent = []
    rank1 = SimpleNamespace(is_main=False, broadcast_text=lambda text, step, what: sent.append(text) or "2026-03-01")
    cfg = load_config(None, [f"train.output_dir={tmp_path}", "data.demo_pairs=8"])
    assert run_template_date(cfg, rank1) == "2026-03-01" and sent == [""]
    rank0 = SimpleNamespace(is_main=True, broadcast_text=lambda text, step, what: text)
    assert run_template_date(cfg, rank0) == "2026-03-02"
    set_day = load_config(None, [f"train.output_dir={tmp_path}", "data.demo_pairs=8", "data.template_date=2024-07-26"])
    assert run_template_date(set_day, rank1) == "2024-07-26"
