"""train.keep_best: the pick on scripted evaluation series (ties, the guard, NaN), the
adapter of the picked step in adapters/ (bitwise, from the checkpoints), across a
resume, with an early stop, and on two ranks."""

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from conftest import make_pairs, make_tiny_model
from dtrain.run import evaluation
from dtrain.run.best import DIRECTIONS, REPORTED, Pick, pick_best
from dtrain.config import load_config
from dtrain.errors import ConfigError, UserError
from dtrain.run.tracking import read_events, read_scalars
from dtrain.run.result import TrainResult
from dtrain.run.trainer import train

ROOT = Path(__file__).resolve().parents[1]

ACC, CHOSEN = "eval/rewards/accuracies", "eval/logps/chosen"


def series(acc: dict, chosen: dict | None = None) -> dict:
    chosen = chosen or {}
    return {s: {ACC: a, CHOSEN: chosen.get(s, -1.0), "eval/loss": 1.0 - a} for s, a in acc.items()}


def test_pick_takes_the_best_and_keeps_the_earlier_of_a_tie():
    evals = series({0: 0.9, 1: 0.5, 2: 0.7, 3: 0.7, 4: 0.6})  # step 0 (the base) never counts
    assert pick_best(evals, ACC) == pick_best({str(k): v for k, v in evals.items()}, ACC)  # checkpoint keys
    p = pick_best(evals, ACC)
    assert (p.step, p.value, p.since, p.guarded) == (2, 0.7, 2, ())
    p = pick_best(evals, "eval/loss")  # lower is better: the same steps
    assert (p.step, p.value, p.since) == (2, pytest.approx(0.3), 2)


def test_guard_excludes_steps_whose_chosen_logps_fell_too_far():
    evals = series({0: 0.2, 1: 0.5, 2: 0.8, 3: 0.9, 4: 0.6}, {0: -1.70, 1: -1.65, 2: -1.79, 3: -1.81, 4: -1.70})
    assert pick_best(evals, ACC).step == 3  # no guard
    p = pick_best(evals, ACC, guard=0.1)  # -1.80 is the floor: step 2 (-1.79) is in, step 3 (-1.81) out
    assert (p.step, p.since, p.guarded) == (2, 2, (3,))
    p = pick_best(evals, ACC, guard=0.0)  # nothing below the base: steps 1 (0.5) and 4 (0.6)
    assert (p.step, p.since, p.guarded) == (4, 0, (2, 3))
    none = pick_best(series({0: 0.2, 1: 0.9}, {0: -1.0, 1: -2.0}), ACC, guard=0.5)
    assert (none.step, none.value, none.since) == (None, None, 1)


def test_the_shipped_rule_log_odds_with_guard_0():
    """configs/preference.yaml's rule (keep_best eval/log_odds_ratio, guard 0.0) on the two patterns of
    docs/defaults.md: accuracy saturates at 1.0 from the first evaluation (demo) — accuracy picks that
    first step on the tie, the log-odds the last — and a late run that pushes both answers down (stack)
    — the guard keeps the one step at or above the base's chosen log-prob."""
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "preference.yaml"))
    rule = (cfg.train.keep_best, cfg.train.keep_best_guard)
    assert rule == ("eval/log_odds_ratio", 0.0) and cfg.orpo.lambda_schedule == "adaptive"
    lor = "eval/log_odds_ratio"
    demo = {s: {ACC: a, lor: o, CHOSEN: c} for s, a, o, c in (
        (0, 0.125, -0.9, -3.40), (10, 1.0, -0.01, -0.48), (20, 1.0, -0.002, -0.33), (30, 1.0, -0.0004, -0.15))}
    assert pick_best(demo, ACC, 0.0).step == 10
    assert pick_best(demo, *rule).step == 30
    stack = {s: {ACC: a, lor: o, CHOSEN: c} for s, a, o, c in (
        (0, 0.6, -0.70, -3.725), (10, 0.6, -0.67, -3.70), (20, 0.6, -0.66, -4.55), (30, 0.4, -0.65, -6.4))}
    assert pick_best(stack, lor).step == 30  # without the guard: the displaced last step
    p = pick_best(stack, *rule)
    assert (p.step, p.value, p.guarded) == (10, -0.67, (20, 30))


def test_non_finite_values_never_count():
    p = pick_best(series({0: 0.1, 1: math.nan, 2: 0.3, 3: math.inf * 0}), ACC)
    assert (p.step, p.since) == (2, 1)


def test_a_non_finite_step_0_chosen_logps_turns_the_guard_off():
    """Nothing is "G below" a NaN base: every step was guarded, so no step qualified and early_stop_evals
    stopped a run whose later steps improved (since 2 here), as if the guard had excluded them."""
    evals = series({0: 0.2, 1: 0.5, 2: 0.7}, {0: math.nan, 1: -1.0, 2: -1.1})
    assert pick_best(evals, ACC, 0.0) == pick_best(evals, ACC) == Pick(2, 0.7, 0, ())


@pytest.mark.parametrize("metric", sorted(DIRECTIONS))
def test_pick_equals_a_brute_force_over_random_series(metric):
    rng = random.Random(hash(metric) % 1000)
    for _ in range(300):
        steps = sorted(rng.sample(range(0, 60), rng.randint(1, 12)))
        evals = {s: {metric: rng.choice([0.1, 0.2, 0.3, rng.random()]), CHOSEN: -1.0 - rng.random() * 0.3}
                 for s in steps}
        guard = rng.choice([None, 0.05, 0.2])
        base = evals.get(0, {}).get(CHOSEN)
        ok = [s for s in steps if s > 0 and (guard is None or base is None or evals[s][CHOSEN] >= base - guard)]
        sign = DIRECTIONS[metric]
        want = min(ok, key=lambda s: (-sign * evals[s][metric], s)) if ok else None
        p = pick_best(evals, metric, guard)
        assert p.step == want
        assert p.since == len([s for s in steps if s > (want or 0)])


# -- in a run: scripted evaluations, real training --------------------------------

# steps 1..6 evaluated; accuracy ties at 2/3, step 4 the highest but its chosen log-prob
# fell 0.2 below step 0's: with guard 0.1 the pick is step 2
SCRIPT_ACC = {0: 0.2, 1: 0.5, 2: 0.7, 3: 0.7, 4: 0.9, 5: 0.6, 6: 0.65}
SCRIPT_CHOSEN = {0: -1.0, 1: -0.95, 2: -0.98, 3: -1.0, 4: -1.2, 5: -1.05, 6: -1.05}


@pytest.fixture
def scripted(monkeypatch):
    """Replace the held-out evaluation by the script (the training steps stay real)."""
    calls = []

    def fake(engine, model, pairs, micro, group, step, bar=None, hyper=None, stop=None):
        calls.append(step)
        return {"eval/loss": 1.0 - SCRIPT_ACC[step], ACC: SCRIPT_ACC[step], CHOSEN: SCRIPT_CHOSEN[step]}, False

    monkeypatch.setattr(evaluation, "evaluate", fake)
    return calls


def run(out, *overrides):
    cfg = load_config(None, [
        f"train.output_dir={out}", "data.demo_pairs=1", "train.steps=6", "train.global_batch_pairs=4",
        "train.micro_batch_pairs=4", "train.learning_rate=1e-2", "lora.rank=2", "train.progress=false",
        "train.eval_every=1", "train.save_every=1", "train.keep_last=10", "train.schedule=constant",
        "train.warmup_steps=0", *overrides,
    ])
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=None, identity="tiny", source="tiny-llama",
                             reference={"path": "tiny-llama"})
    pairs = make_pairs(12)
    return train(cfg, loaded=loaded, dataset=SimpleNamespace(train=pairs[:9], valid=pairs[9:], fingerprint="fp"))


def weights(folder: Path) -> dict:
    return mx.load(str(folder / "adapters.safetensors"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_adapters_hold_the_picked_step_and_adapters_last_the_last(tmp_path, scripted):
    result = run(tmp_path, f"train.keep_best={ACC}", "train.keep_best_guard=0.1")
    assert scripted == [0, 1, 2, 3, 4, 5, 6] and result.best.step == 2 and result.best.guarded == (4,)
    ck = tmp_path / "checkpoints"
    assert same(weights(tmp_path / "adapters"), weights(ck / "step-0000002"))
    assert same(weights(tmp_path / "adapters-last"), weights(ck / "step-0000006"))
    assert not same(weights(ck / "step-0000002"), weights(ck / "step-0000006"))
    assert result.summary() == ("eval reward accuracy (chosen preferred over rejected): step 0 0.200 -> step 6 0.650; "
                                f"adapters/ holds step 2 ({ACC} 0.7000)")
    scalars = read_scalars(result.run_dir)
    assert scalars["best/step"] == [(1, 1.0), (2, 2.0), (3, 2.0), (4, 2.0), (5, 2.0), (6, 2.0)]
    texts = [v.tensor.string_val[0].decode() for e in read_events(result.run_dir) for v in e.summary.value
             if v.tag.startswith("best") and v.HasField("tensor")]
    assert texts == [f"adapters/ holds step 2 ({ACC} 0.7000)"]
    unguarded = run(tmp_path / "unguarded", f"train.keep_best={ACC}")
    assert unguarded.best.step == 4
    assert same(weights(tmp_path / "unguarded" / "adapters"), weights(tmp_path / "unguarded/checkpoints/step-0000004"))


def test_off_writes_the_last_step_to_adapters_only(tmp_path, scripted):
    result = run(tmp_path)
    assert result.best is None and not (tmp_path / "adapters-last").exists()
    assert same(weights(tmp_path / "adapters"), weights(tmp_path / "checkpoints" / "step-0000006"))
    assert "best/step" not in read_scalars(result.run_dir)


def test_resume_after_the_best_step_still_writes_it(tmp_path, scripted):
    """Cut after step 3 (best so far: step 2, kept in the checkpoint), resume to step 6:
    adapters/, adapters-last/ and the last checkpoint's weights are the uninterrupted run's bytes."""
    args = (f"train.keep_best={ACC}", "train.keep_best_guard=0.1")
    run(tmp_path / "whole", *args)
    cut = run(tmp_path / "cut", *args, "train.steps=3")
    assert cut.best.step == 2 and (tmp_path / "cut" / "checkpoints" / "step-0000003" / "best.safetensors").is_file()
    resumed = run(tmp_path / "cut", *args, "train.resume=auto")
    assert resumed.best.step == 2 and len(resumed.history) == 3
    for name in ("adapters/adapters.safetensors", "adapters-last/adapters.safetensors",
                 "checkpoints/step-0000006/best.safetensors", "checkpoints/step-0000006/optimizer.safetensors"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes(), name
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-0000006" / "state.json").read_text())
    assert state["best_step"] == 2


def test_a_failed_adapters_write_names_where_the_best_steps_weights_are(tmp_path, scripted, monkeypatch):
    """adapters/ holds step 2, the best; its write failing said "checkpoint step-0000006 holds the same weights",
    whose adapters.safetensors are step 6's: the best step's copy there is its best.safetensors."""
    import errno

    from dtrain.files import StorageError

    real = mx.save_safetensors

    def save(path, *a, **k):
        if Path(path).parent.name.startswith(".adapters.tmp-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr(mx, "save_safetensors", save)
    with pytest.raises(StorageError) as err:
        run(tmp_path, f"train.keep_best={ACC}", "train.keep_best_guard=0.1")
    last = tmp_path / "checkpoints" / "step-0000006"
    assert str(err.value) == (f"could not write the adapter {tmp_path}/adapters: No space left on device; checkpoint "
                              f"{last} holds step 2's weights in best.safetensors")
    assert same(mx.load(str(last / "best.safetensors")), weights(tmp_path / "checkpoints" / "step-0000002"))


def test_early_stop_after_n_evaluations_without_a_new_best(tmp_path, scripted):
    """Best at step 2; step 3 ties and step 4 is guarded: 2 evaluations without a new best."""
    result = run(tmp_path, f"train.keep_best={ACC}", "train.keep_best_guard=0.1", "train.early_stop_evals=2")
    assert result.early_stopped and result.steps == 4 and len(result.history) == 4
    assert scripted == [0, 1, 2, 3, 4]
    assert same(weights(tmp_path / "adapters"), weights(tmp_path / "checkpoints" / "step-0000002"))
    assert same(weights(tmp_path / "adapters-last"), weights(tmp_path / "checkpoints" / "step-0000004"))
    assert "early stop at step 4; adapters/ holds step 2" in result.summary()
    assert best_texts(result.run_dir) == [(4, f"early stop at step 4; adapters/ holds step 2 ({ACC} 0.7000)")]
    again = run(tmp_path, f"train.keep_best={ACC}", "train.keep_best_guard=0.1", "train.early_stop_evals=2",
                "train.resume=auto")  # a resumed run that had stopped early trains nothing more
    assert again.early_stopped and again.steps == 4 and again.history == []


def test_an_early_stop_after_one_evaluation_says_one_evaluation(tmp_path, scripted, capsys):
    """train.early_stop_evals 1: step 3 ties step 2's accuracy. The notice said '1 evaluations without a new best'."""
    result = run(tmp_path, f"train.keep_best={ACC}", "train.early_stop_evals=1")
    assert result.early_stopped and result.steps == 3
    assert f"step 3: 1 evaluation without a new best {ACC}; stopping early" in capsys.readouterr().err.splitlines()


def test_the_best_text_says_so_when_no_step_qualified(tmp_path, scripted):
    """No evaluation reports eval/nll_loss (NaN to the pick): adapters/ holds the last step, as the summary
    says; TensorBoard had no `best` text at all, though it reads as the summary's end for a kept step."""
    result = run(tmp_path, "train.keep_best=eval/nll_loss")
    assert result.best.step is None and result.summary().endswith(
        "; no evaluated step qualified for train.keep_best; adapters/ holds the last step")
    assert best_texts(result.run_dir) == [(6, "no evaluated step qualified for train.keep_best; adapters/ holds "
                                              "the last step")]
    assert same(weights(tmp_path / "adapters"), weights(tmp_path / "checkpoints" / "step-0000006"))


def best_texts(run_dir) -> list:
    return [(e.step, v.tensor.string_val[0].decode()) for e in read_events(run_dir) for v in e.summary.value
            if v.tag.startswith("best") and v.HasField("tensor")]


def test_an_early_stop_due_at_the_last_evaluation_is_reported_and_kept_over_a_resume(tmp_path, scripted, capsys):
    """Best at step 4; steps 5 and 6 bring none: train.early_stop_evals 2 is reached at the last evaluation.
    It was said nowhere (no notice, no "early stop" in the summary or TensorBoard), and a resume to more
    steps then trained nothing, saying nothing but "early stop" in its summary."""
    args = (f"train.keep_best={ACC}", "train.early_stop_evals=2")
    first = run(tmp_path, *args)
    assert len(first.history) == 6 and first.steps == 6 and first.early_stopped
    assert (f"step 6: 2 evaluations without a new best {ACC}: an early stop at the run's last step (a resume "
            f"with a larger train.steps trains no further)") in capsys.readouterr().err.splitlines()
    summary = ("eval reward accuracy (chosen preferred over rejected): step 0 0.200 -> step 6 0.650; "
               f"early stop at step 6; adapters/ holds step 4 ({ACC} 0.9000)")
    assert first.summary() == summary
    assert best_texts(first.run_dir) == [(6, f"early stop at step 6; adapters/ holds step 4 ({ACC} 0.9000)")]
    again = run(tmp_path, *args, "train.resume=auto")  # the finished run: the same summary
    assert again.history == [] and again.summary() == summary
    longer = run(tmp_path, *args, "train.steps=8", "train.resume=auto")
    assert longer.history == [] and longer.steps == 6 and longer.summary() == summary
    assert (f"step 6: 2 evaluations without a new best {ACC} stopped this run early; a resume trains no further"
            in capsys.readouterr().err.splitlines())
    assert best_texts(first.run_dir) == [(6, f"early stop at step 6; adapters/ holds step 4 ({ACC} 0.9000)")]


def test_resume_of_an_early_stopped_run_saves_and_logs_nothing_again(tmp_path, scripted, capsys):
    """As a finished run's resume: no second "stopping early", checkpoint and hparams record untouched,
    the adapter folders rewritten with the same bytes."""
    args = (f"train.keep_best={ACC}", "train.keep_best_guard=0.1", "train.early_stop_evals=2")
    first = run(tmp_path, *args)
    step_4 = tmp_path / "checkpoints" / "step-0000004"
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in step_4.iterdir()}
    adapters = {f: (tmp_path / f / "adapters.safetensors").read_bytes() for f in ("adapters", "adapters-last")}
    capsys.readouterr()
    again = run(tmp_path, *args, "train.resume=auto")
    assert again.early_stopped and again.steps == 4 and again.history == [] and scripted == [0, 1, 2, 3, 4]
    assert "stopping early" not in capsys.readouterr().err
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in step_4.iterdir()} == files
    assert {f: (tmp_path / f / "adapters.safetensors").read_bytes() for f in adapters} == adapters
    assert again.run_dir == first.run_dir
    tags = [v.tag for e in read_events(again.run_dir) for v in e.summary.value]
    assert tags.count("_hparams_/experiment") == 1 and tags.count("best/text_summary") == 1


def test_resume_of_a_finished_run_writes_the_best_text_once(tmp_path, scripted):
    """The `best` text entry goes with the run's final record: a resume of the last checkpoint adds none
    (it wrote a second entry at step 6, beside the first, which the purge at step 7 keeps)."""
    args = (f"train.keep_best={ACC}", "train.keep_best_guard=0.1")
    first = run(tmp_path, *args)
    again = run(tmp_path, *args, "train.resume=auto")
    assert again.run_dir == first.run_dir and again.best.step == 2
    texts = [(e.step, v.tensor.string_val[0].decode()) for e in read_events(again.run_dir) for v in e.summary.value
             if v.tag.startswith("best") and v.HasField("tensor")]
    assert texts == [(6, f"adapters/ holds step 2 ({ACC} 0.7000)")]


def hparams_metrics(run_dir) -> tuple:
    """The HPARAMS record: its experiment's metric tags and their ``hparam/`` scalars (step, value)."""
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    tags = [m.name.tag for e in read_events(run_dir) for v in e.summary.value if v.tag == "_hparams_/experiment"
            for m in HParamsPluginData.FromString(v.metadata.plugin_data.content).experiment.metric_infos]
    return tags, {k: v for k, v in read_scalars(run_dir).items() if k.startswith("hparam/")}


@pytest.mark.parametrize("extra, last", [((), 6), (("train.early_stop_evals=2",), 4)], ids=["end", "early-stop"])
def test_the_hparams_record_holds_the_kept_steps_eval_metrics(tmp_path, scripted, extra, last):
    """adapters/ holds step 2 (accuracy 0.7), but the HPARAMS record held the last step's eval metrics (step 6:
    0.65; step 4, 0.9, at the early stop): runs compared in TensorBoard's HPARAMS tab were compared by adapters
    they did not write. It holds the kept step's eval metrics and hparam/best/step; the training metrics and the
    eval/ scalars stay the last step's."""
    result = run(tmp_path, f"train.keep_best={ACC}", "train.keep_best_guard=0.1", *extra)
    tags, scalars = hparams_metrics(result.run_dir)
    assert "hparam/best/step" in tags and f"hparam/{ACC}" in tags
    assert scalars["hparam/best/step"] == [(last, 2.0)]
    assert scalars[f"hparam/{ACC}"] == [(last, pytest.approx(SCRIPT_ACC[2]))]
    assert scalars["hparam/eval/loss"] == [(last, pytest.approx(1.0 - SCRIPT_ACC[2]))]
    assert scalars[f"hparam/{CHOSEN}"] == [(last, pytest.approx(SCRIPT_CHOSEN[2]))]
    assert scalars["hparam/loss"] == [(last, pytest.approx(result.history[-1]["loss"]))]
    assert read_scalars(result.run_dir)[ACC][-1] == (last, pytest.approx(SCRIPT_ACC[last]))
    again = run(tmp_path, f"train.keep_best={ACC}", "train.keep_best_guard=0.1", *extra, "train.resume=auto")
    assert hparams_metrics(again.run_dir) == (tags, scalars)  # a resume of the run's end writes no other record


def test_the_hparams_record_without_a_kept_step_holds_the_last_steps_eval_metrics(tmp_path, scripted):
    """No step qualified (no evaluation reports eval/nll_loss): adapters/ holds the last step, as the record does."""
    tags, scalars = hparams_metrics(run(tmp_path, "train.keep_best=eval/nll_loss").run_dir)
    assert "hparam/best/step" not in tags and "hparam/best/step" not in scalars
    assert scalars[f"hparam/{ACC}"] == [(6, pytest.approx(SCRIPT_ACC[6]))]
    off_tags, off = hparams_metrics(run(tmp_path / "off").run_dir)
    assert off_tags == tags and off[f"hparam/{ACC}"] == [(6, pytest.approx(SCRIPT_ACC[6]))]


def test_the_sft_summary_names_the_kept_step_and_the_early_stop():
    """SFT has no accuracy: its summary is the held-out NLL, and with keep_best it still says which step
    adapters/ holds (and that the run stopped early), as the preference objectives' summary does."""
    nll = "eval/nll_loss"
    evals = {s: {"eval/loss": v, nll: v, CHOSEN: -v} for s, v in ((0, 2.0), (5, 1.5), (10, 1.7), (15, 1.8))}
    result = TrainResult(steps=15, evals=evals, best=pick_best(evals, nll), best_metric=nll, early_stopped=True)
    assert result.summary() == ("eval NLL of the completions: step 0 2.000 -> step 15 1.800; early stop at step 15; "
                                f"adapters/ holds step 5 ({nll} 1.500)")
    assert TrainResult(steps=15, evals=evals).summary() == "eval NLL of the completions: step 0 2.000 -> step 15 1.800"


def test_the_summary_shows_small_values_by_their_significant_digits():
    """An SFT run whose held-out NLL fell to 4.5e-6 (a memorised set) printed 'step 10 0.000' and its kept
    step's 'eval/nll_loss 0.0000', as did a DPO run kept by a margin of 2.5e-5: the values were lost, and
    steps that differ read the same. They print with 4 significant digits; an accuracy (a share) as before."""
    nll, margins = "eval/nll_loss", "eval/rewards/margins"
    evals = {s: {"eval/loss": v, nll: v} for s, v in ((0, 2.0), (5, 3.2e-6), (10, 4.5e-6))}
    result = TrainResult(steps=10, evals=evals, best=pick_best(evals, nll), best_metric=nll)
    assert result.summary() == ("eval NLL of the completions: step 0 2.000 -> step 10 4.500e-06; "
                                f"adapters/ holds step 5 ({nll} 3.200e-06)")
    evals = {s: {ACC: a, margins: m} for s, a, m in ((0, 0.0, 0.0), (5, 0.5, 2.5e-5), (10, 0.5, -1e-6))}
    result = TrainResult(steps=10, evals=evals, best=pick_best(evals, margins), best_metric=margins)
    assert result.summary() == ("eval reward accuracy (chosen preferred over rejected): step 0 0.000 -> step 10 "
                                f"0.500; adapters/ holds step 5 ({margins} 2.500e-05)")
    # a whole number kept no bare point ('2497.', as IPO's loss at beta 0.01 would read)
    evals = {s: {"eval/loss": v, nll: v} for s, v in ((0, 3000.0), (5, 2497.0), (10, 2500.5))}
    result = TrainResult(steps=10, evals=evals, best=pick_best(evals, nll), best_metric=nll)
    assert result.summary() == (f"eval NLL of the completions: step 0 3000 -> step 10 2500; "
                                f"adapters/ holds step 5 ({nll} 2497)")


def test_keep_best_needs_evaluations(tmp_path):
    with pytest.raises(ConfigError, match=r"command line: 'train.keep_best: eval/loss' needs held-out evaluations "
                                          r"during the run: set 'train.eval_every' > 0 \(it is 0\)"):
        load_config(None, ["data.demo_pairs=1", "train.keep_best=eval/loss"])
    with pytest.raises(ConfigError, match=r"'train.early_stop_evals' \(3\) needs 'train.keep_best' \(it is off\)"):
        load_config(None, ["data.demo_pairs=1", "train.early_stop_evals=3", "train.eval_every=2"])
    with pytest.raises(ConfigError, match=r"key 'train.keep_best' must be one of eval/rewards/accuracies"):
        load_config(None, ["data.demo_pairs=1", "train.keep_best=accuracy", "train.eval_every=2"])
    cfg = load_config(None, [f"train.output_dir={tmp_path}", "data.demo_pairs=1", "train.keep_best=eval/loss",
                             "train.eval_every=1", "lora.rank=2", "train.progress=false"])
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=None, identity="tiny", source="tiny-llama",
                             reference={"path": "tiny-llama"})
    with pytest.raises(UserError) as err:
        train(cfg, loaded=loaded, dataset=SimpleNamespace(train=make_pairs(9), valid=[], fingerprint="fp"))
    assert str(err.value) == ("train.keep_best needs held-out pairs, and this run has none: data.valid_fraction 0.1 "
                              "of 9 pairs gives none (it holds out whole prompts, one kept to train on): set "
                              "data.valid or add pairs of other prompts (or turn it off)")
    cfg.data.valid_fraction = 0.0
    with pytest.raises(UserError) as err:
        train(cfg, loaded=loaded, dataset=SimpleNamespace(train=make_pairs(9), valid=[], fingerprint="fp"))
    assert str(err.value) == ("train.keep_best needs held-out pairs, and this run has none: set data.valid or "
                              "data.valid_fraction > 0 (or turn it off)")
    assert not any(tmp_path.iterdir())  # nothing written
    cfg.orpo.lambda_schedule = "adaptive"
    with pytest.raises(UserError) as err:
        train(cfg, loaded=loaded, dataset=SimpleNamespace(train=make_pairs(9), valid=[], fingerprint="fp"))
    assert str(err.value).startswith("train.keep_best and orpo.lambda_schedule: adaptive need held-out pairs")


def test_two_ranks_pick_the_same_step_and_rank_0_writes_it(tmp_path):
    """Real evaluations all-reduced over 2 ranks, with the λ controller on: both ranks train
    the same λ sequence to the same weights and stop at the same step; rank 0's adapters/
    is the checkpoint of the step the evaluation series picks (step 3 of 4 when this was
    written: eval/nll_loss 6.75, 6.52, 6.35, then 6.97 stopped the run)."""
    from test_distributed import finish as finish_ranks
    from test_distributed import start_ring

    args = ("train.steps=6", "train.eval_every=1", "train.save_every=1", "train.keep_last=10",
            "train.keep_best=eval/nll_loss", "train.early_stop_evals=1", "train.learning_rate=0.05",
            "orpo.lambda_schedule=adaptive", "orpo.lambda_epsilon=10", "distributed.collective_timeout_s=30")
    ranks = finish_ranks(start_ring(2, tmp_path, *args), timeout=150)
    assert [rc for rc, _, _ in ranks] == [0, 0], ranks
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[0]["evals"] == reports[1]["evals"] and reports[0]["steps"] == reports[1]["steps"]
    lams = [[h["train/lambda"] for h in r["history"]] for r in reports]
    assert lams[0] == lams[1] and lams[0][:3] == pytest.approx([0.05, 0.10, 0.15])  # ε 10: a ramp from step 2
    assert same(mx.load(str(tmp_path / "rank0.safetensors")), mx.load(str(tmp_path / "rank1.safetensors")))
    evals = {int(k): v for k, v in reports[0]["evals"].items()}
    want = min((s for s in evals if s > 0), key=lambda s: (evals[s]["eval/nll_loss"], s))
    assert reports[0]["best_step"] == reports[1]["best_step"] == want
    assert reports[0]["steps"] == min(want + 1, 6)  # early stop at the first evaluation without a new best
    out = tmp_path / "run"
    assert same(weights(out / "adapters"), weights(out / "checkpoints" / f"step-{want:07d}"))
    last = reports[0]["steps"]
    assert same(weights(out / "adapters-last"), weights(out / "checkpoints" / f"step-{last:07d}"))


@pytest.mark.parametrize("kind", ["orpo", "dpo", "simpo", "sft"])
def test_each_objective_reports_the_keep_best_metrics_the_config_allows_it(kind):
    from dtrain.config import Config
    from dtrain.engine import make_objective

    obj = make_objective(Config(), kind)
    reported = obj.finalize(dict.fromkeys(obj.metric_keys, 1.0), "eval/")
    assert sorted(REPORTED[kind]) == sorted(m for m in DIRECTIONS if m in reported)


@pytest.mark.parametrize("kind", sorted(REPORTED))
def test_dtrain_config_lists_the_keep_best_metrics_of_the_objective(kind):
    """README: the metrics keep_best accepts depend on objective.kind, and ``dtrain config`` lists them."""
    from dtrain.config_text import describe

    cfg = load_config(None, ["data.demo_pairs=1", f"objective.kind={kind}"])
    (line,) = [x for x in describe(cfg).splitlines() if x.strip().startswith("keep_best:")]
    assert line.endswith(f"[null | {' | '.join(REPORTED[kind])}]")


def test_keep_best_guard_is_refused_for_dpo_whose_logps_are_sums_per_response():
    args = ["data.demo_pairs=4", "train.eval_every=1", "train.keep_best=eval/loss", "train.keep_best_guard=0.0"]
    for loss_type in ("sigmoid", "hinge"):
        with pytest.raises(ConfigError) as err:
            load_config(None, args + ["objective.kind=dpo", f"objective.loss_type={loss_type}"])
        assert str(err.value) == (f"command line: 'train.keep_best_guard' (0.0) is in nats/token, but objective.kind "
                                  f"dpo with loss_type {loss_type} logs eval/logps/chosen as a sum per response; "
                                  f"remove it")
    # mean log-probs per token, the guard's unit (DPO ipo: the mean log-probs its loss scores)
    for kind in (["objective.kind=orpo"], ["objective.kind=simpo"], ["objective.kind=sft"],
                 ["objective.kind=dpo", "objective.loss_type=ipo"]):
        assert load_config(None, args + kind).train.keep_best_guard == 0.0


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_the_guard_config_and_the_objective_agree_on_which_dpo_logps_are_per_token(loss_type):
    """config._check and DPO.per_token_logps (the drop warning's switch) state one rule twice."""
    from dtrain.engine import make_objective

    args = ["data.demo_pairs=4", "train.eval_every=1", "train.keep_best=eval/loss", "objective.kind=dpo",
            f"objective.loss_type={loss_type}"]
    per_token = make_objective(load_config(None, args)).per_token_logps
    try:
        load_config(None, args + ["train.keep_best_guard=0.0"])
        accepted = True
    except ConfigError:
        accepted = False
    assert accepted == per_token == (loss_type == "ipo")


def test_keep_best_of_a_metric_the_objective_does_not_report_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=4", "objective.kind=sft", "train.eval_every=1",
                           "train.keep_best=eval/rewards/accuracies"])
    assert str(err.value) == ("command line: 'train.keep_best' is eval/rewards/accuracies but objective.kind sft does "
                              "not report it; choose one of eval/loss, eval/nll_loss")


@pytest.mark.parametrize("metric", ["eval/loss", "eval/rewards/margins"])
def test_keep_best_of_a_lambda_weighted_metric_under_the_lambda_controller_is_a_config_error(metric):
    """ORPO's eval/loss (NLL + λ·OR) and rewards/margins (λ times a log-prob gap) are weighted by the λ of
    the moment: under orpo.lambda_schedule adaptive each evaluation has its own, so the pick compared a λ
    ramp, not the model (a rising λ raises eval/loss: adapters/ held a step from before the ramp, and
    train.early_stop_evals stopped runs whose held-out odds still improved)."""
    args = ["data.demo_pairs=4", "train.eval_every=1", "orpo.lambda_schedule=adaptive", f"train.keep_best={metric}"]
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    assert str(err.value) == (f"command line: 'train.keep_best' is {metric}, which is weighted by lambda, and "
                              f"orpo.lambda_schedule adaptive changes lambda between evaluations, so they do not "
                              f"compare; choose eval/rewards/accuracies, eval/log_odds_ratio or eval/nll_loss")
    assert load_config(None, args[:-1] + ["train.keep_best=eval/log_odds_ratio"]).train.keep_best
    assert load_config(None, args[:2] + [f"train.keep_best={metric}"]).train.keep_best == metric  # static λ


def test_a_config_for_another_objective_names_every_broken_rule_in_one_error():
    """configs/preference.yaml is ORPO's: switching its objective breaks three rules, and the user
    sees all three at once rather than one per attempt."""
    with pytest.raises(ConfigError) as err:
        load_config(str(ROOT / "configs" / "preference.yaml"), ["objective.kind=dpo", "data.train=x.jsonl"])
    lines = str(err.value).splitlines()
    assert lines[0] == f"{ROOT / 'configs' / 'preference.yaml'} with the command line's overrides: 3 problems:"
    assert [x.split("'")[1] for x in lines[1:]] == ["orpo.lambda_schedule", "train.keep_best", "train.keep_best_guard"]
    assert all(x.startswith("  - ") for x in lines[1:])


def test_keep_best_guard_without_keep_best_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=4", "train.keep_best_guard=0.1"])
    assert str(err.value) == ("command line: 'train.keep_best_guard' (0.1) needs 'train.keep_best' (it is off): "
                              "the guard only filters the steps keep_best chooses from; with keep_best off, unset it "
                              "too (--train.keep_best_guard null)")
    # configs/preference.yaml with keep_best turned off said only that the guard needs it, not how to turn it off
    with pytest.raises(ConfigError) as err:
        load_config(str(ROOT / "configs" / "preference.yaml"), ["train.keep_best=null", "train.early_stop_evals=2"])
    assert [x.split("(it is off): ")[1] for x in str(err.value).splitlines()[1:]] == [
        "the guard only filters the steps keep_best chooses from; with keep_best off, unset it too "
        "(--train.keep_best_guard null)",
        "the stop keeps the best step; with keep_best off, set it to 0 too (--train.early_stop_evals 0)"]
    cfg = load_config(str(ROOT / "configs" / "preference.yaml"), ["train.keep_best=null", "train.keep_best_guard=null"])
    assert (cfg.train.keep_best, cfg.train.keep_best_guard) == (None, None)


def test_steering_by_a_handful_of_held_out_pairs_gets_a_notice(tmp_path, capsys):
    """keep_best over 3 held-out pairs: each pair is 0.33 of the accuracy; the run says so once."""
    from dtrain.run.held_out import FEW_HELD_OUT

    run(tmp_path / "few", f"train.keep_best={ACC}")
    err = capsys.readouterr().err
    want = (f"train.keep_best steers by the held-out metrics, here over 3 pair(s): one pair moves "
            f"eval/rewards/accuracies by 0.33, so the choices follow noise; keep {FEW_HELD_OUT}+ held-out pairs "
            "(data.valid or data.valid_fraction)")
    assert err.count(want) == 1, err
    run(tmp_path / "off")
    assert "steers by the held-out metrics" not in capsys.readouterr().err  # nothing steers: nothing said


def test_the_few_held_out_pairs_notice_of_an_sft_run_names_no_accuracy(tmp_path, capsys):
    """SFT reports no eval/rewards/accuracies (no rejected side): the notice said one pair moves it by 0.33."""
    from dtrain.run.held_out import FEW_HELD_OUT

    run(tmp_path, "objective.kind=sft", "train.keep_best=eval/nll_loss")
    err = capsys.readouterr().err
    assert err.count(f"train.keep_best steers by the held-out metrics, here over 3 row(s), so the choices follow "
                     f"noise; keep {FEW_HELD_OUT}+ held-out rows (data.valid or data.valid_fraction)") == 1, err
    assert "accuracies" not in err


def test_an_sft_run_without_held_out_rows_is_told_of_rows(tmp_path):
    from dtrain.run.held_out import held_out_steering

    cfg = load_config(None, ["data.train=rows.jsonl", "objective.kind=sft", "train.keep_best=eval/nll_loss",
                             "train.eval_every=1"])
    with pytest.raises(UserError) as err:
        held_out_steering(cfg, 9, 0)
    assert str(err.value) == ("train.keep_best needs held-out rows, and this run has none: data.valid_fraction 0.1 of "
                              "9 rows gives none (it holds out whole prompts, one kept to train on): set data.valid "
                              "or add rows of other prompts (or turn it off)")


def test_the_notice_counts_the_pairs_evaluated_not_the_pairs_held_out(tmp_path, capsys):
    """train.eval_pairs limits the evaluation: 2 of the 3 held-out pairs are what keep_best reads."""
    run(tmp_path, f"train.keep_best={ACC}", "train.eval_pairs=2")
    err = capsys.readouterr().err
    assert err.count("train.keep_best steers by the held-out metrics, here over 2 pair(s): one pair moves "
                     "eval/rewards/accuracies by 0.50") == 1, err
    assert "train.eval_pairs limits them to 2)" in err


def test_orpo_only_rules_are_not_repeated_for_another_objective():
    """Under objective.kind dpo the lambda keys are reported once as not read, not again as ORPO's rules."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=4", "objective.kind=dpo", "orpo.lambda_schedule=adaptive",
                           "orpo.lambda_min=0.9", "orpo.lambda_max=0.2", "train.eval_every=0"])
    lines = str(err.value).splitlines()
    assert lines[0] == "command line: 3 problems:"
    assert [x.split("'")[1] for x in lines[1:]] == ["orpo.lambda_schedule", "orpo.lambda_min", "orpo.lambda_max"]
    assert all("does not read it" in x for x in lines[1:])


def test_the_dpo_summary_says_why_step_0_prefers_no_pair():
    """DPO's step-0 model is its reference: every reward is 0 and no pair counts as preferred, so the summary
    began 'step 0 0.000', which read as a model preferring every rejected answer."""
    dpo = {0: {ACC: 0.0, "eval/rewards/chosen": 0.0, "eval/rewards/rejected": 0.0},
           8: {ACC: 0.75, "eval/rewards/chosen": 0.1, "eval/rewards/rejected": -0.2}}
    assert TrainResult(steps=8, evals=dpo).summary() == (
        "eval reward accuracy (chosen preferred over rejected): step 0 0.000 (the reference itself: every reward 0) "
        "-> step 8 0.750")
    orpo = {0: {ACC: 0.25, "eval/rewards/chosen": -0.3, "eval/rewards/rejected": -0.3}, 8: dpo[8]}
    assert TrainResult(steps=8, evals=orpo).summary() == (
        "eval reward accuracy (chosen preferred over rejected): step 0 0.250 -> step 8 0.750")


def test_the_reference_note_is_dpo_s_alone():
    """ORPO with orpo.lambda 0 reports every reward as 0 * logps = 0 (rewards/accuracies compares the
    log-probabilities themselves): its step 0 is no reference model, and 0.250 needs no explaining."""
    orpo = {0: {ACC: 0.25, "eval/rewards/chosen": -0.0, "eval/rewards/rejected": -0.0, "eval/nll_loss": 2.0},
            8: {ACC: 0.75, "eval/rewards/chosen": -0.0, "eval/rewards/rejected": -0.0, "eval/nll_loss": 1.5}}
    assert TrainResult(steps=8, evals=orpo).summary() == (
        "eval reward accuracy (chosen preferred over rejected): step 0 0.250 -> step 8 0.750")


def test_an_evaluation_that_raises_leaves_the_model_in_training_mode():
    """``evaluate`` puts the model in evaluation mode (LoRA dropout off); an error from the engine
    left it there, so a caller that went on (the API, a retry) trained without dropout."""
    from dtrain.distributed import Group
    from dtrain.engine import ORPO, ReferenceEngine

    class Failing(ReferenceEngine):
        def evaluate(self, *args, **kwargs):
            raise RuntimeError("engine failed")

    model = make_tiny_model()
    model.train()
    with pytest.raises(RuntimeError, match="engine failed"):
        evaluation.evaluate(Failing(model, ORPO(0.1)), model, make_pairs(2), 1, Group(), 3)
    assert model.training


def test_eval_metrics_are_means_over_the_held_out_pairs_and_the_readme_says_trl_averages_batches():
    """3 held-out pairs in micro-batches of 2 (the last one short): p0 and p1 prefer the chosen side (mean
    log-probs -1 vs -2), p2 not (-2 vs -1). eval/ means are over pairs: accuracy 2/3, logps/chosen -4/3,
    rewards/chosen 0.5 * -4/3; TRL's mean of per-batch means would give (1 + 0) / 2 = 0.5 and
    (-1 + -2) / 2 = -1.5. The README says which."""
    from dtrain.distributed import Group
    from dtrain.engine import ORPO
    from dtrain.engine.common import StepResult
    from dtrain.engine.objective import PairLogps
    from dtrain.types import TokenizedPair

    logps = {"p0": (-1.0, -2.0), "p1": (-1.0, -2.0), "p2": (-2.0, -1.0)}

    class Scripted:  # an engine scoring each pair by its script, one token per response
        objective = ORPO(0.5)

        def evaluate(self, chunk, totals, key=None, hyper=None):
            c, r = (mx.array([logps[p.source][i] for p in chunk]) for i in (0, 1))
            ones = mx.ones((len(chunk),))
            loss, sums = self.objective.loss(PairLogps(c, r, ones, ones, -c.sum()), totals, self.objective.hyper())
            n = float(len(chunk))
            return StepResult(loss, {**sums, "pairs": n, "nll_tokens": n, "input_tokens": 3 * n, "fallback_pairs": 0.0,
                                     "computed_tokens": 3 * n})

    class Model:
        def eval(self):
            pass

        def train(self):
            pass

    pairs = [TokenizedPair([1], [5], [6], source) for source in logps]
    m, stopped = evaluation.evaluate(Scripted(), Model(), pairs, 2, Group(), 0)
    assert not stopped
    assert m["eval/rewards/accuracies"] == pytest.approx(2 / 3) and m["eval/logps/chosen"] == pytest.approx(-4 / 3)
    assert m["eval/rewards/chosen"] == pytest.approx(0.5 * -4 / 3) and m["eval/nll_loss"] == pytest.approx(4 / 3)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    paragraph = " ".join(readme.split("### Objective and metrics", 1)[1].split("**Healthy or degenerate?**", 1)[0].split())
    assert ("means over the pairs of the step's global batch or of the whole held-out set (`nll_loss`: over "
            "their tokens)") in paragraph and "TRL averages per-batch means" in paragraph


def test_steering_with_no_evaluation_before_the_last_step_gets_a_notice(tmp_path, capsys):
    """train.eval_every >= train.steps evaluates only step 0 and the last: keep_best wrote the last step to both
    adapters/ and adapters-last/ and the adaptive lambda controller never moved lambda, silently. A run extended
    by a resume does steer by the last step's evaluation, so it is a notice, not an error."""
    run(tmp_path / "once", f"train.keep_best={ACC}", "orpo.lambda_schedule=adaptive", "train.eval_every=6")
    want = ("train.keep_best and orpo.lambda_schedule: adaptive steer by evaluations during the run, and "
            "train.eval_every 6 >= train.steps 6 evaluates only step 0 and the last: adapters/ holds the last step "
            "and lambda stays orpo.lambda_min; set train.eval_every below train.steps")
    assert capsys.readouterr().err.count(want) == 1
    run(tmp_path / "twice", f"train.keep_best={ACC}", "train.eval_every=5")
    assert "evaluates only step 0 and the last" not in capsys.readouterr().err


def test_no_held_out_pairs_advice_names_where_they_came_from(tmp_path):
    """A held-out source of its own that gave no usable pairs was told to 'set data.valid or data.valid_fraction > 0'
    (data.valid set) or that data.valid_fraction gave none (an mlx-lm folder's valid.jsonl): such a source now stops
    the run as it loads (tests/test_data_dataset.py); what is left is data.valid_fraction's advice."""
    from dtrain.run.held_out import held_out_steering

    base = ["train.keep_best=eval/loss", "train.eval_every=1", f"data.train={tmp_path}"]
    start = "train.keep_best needs held-out pairs, and this run has none: "
    cases = [([], "data.valid_fraction 0.1 of 9 pairs gives none (it holds out whole prompts, one kept to train "
                  "on): set data.valid or add pairs of other prompts"),
             (["data.valid_fraction=0.0"], "set data.valid or data.valid_fraction > 0")]
    for overrides, fix in cases:
        cfg = load_config(None, base + overrides)
        with pytest.raises(UserError) as err:
            held_out_steering(cfg, 9, 0)
        assert str(err.value) == f"{start}{fix} (or turn it off)", overrides
