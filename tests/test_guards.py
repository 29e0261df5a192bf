"""The held-out chosen log-probability guard (dtrain/run/guards.py) and its hook in the trainer."""

import random
from types import SimpleNamespace

from conftest import make_pairs, make_tiny_model
from dtrain.config import load_config
from dtrain.run.guards import chosen_logps_drop, non_finite_eval
from dtrain.run.trainer import train
from dtrain.types import TokenizedPair


def history(*chosen):
    """Evals at steps 0, 10, 20, ... with the given eval/logps/chosen values."""
    return {10 * i: {"eval/logps/chosen": v, "eval/rewards/accuracies": 0.5} for i, v in enumerate(chosen)}


def test_warning_text_names_step_values_key_and_remedy():
    # step 0: -1.66; step 20: -1.91, 0.25 below, margin 0.1
    assert chosen_logps_drop(history(-1.66, -1.70, -1.91), 0.1) == (
        "warning: step 20: held-out eval/logps/chosen is -1.9100, 0.2500 nats/token below its step-0 value "
        "-1.6600 (train.chosen_logps_drop_warn: 0.1); the model is making the chosen answers less likely too; "
        "try a lower train.learning_rate or orpo.lambda")


def test_the_remedy_follows_the_objective():
    tail = "the model is making the chosen answers less likely too; try a lower train.learning_rate"
    assert chosen_logps_drop(history(-1.66, -1.91), 0.1, "simpo").endswith(
        tail + ", or a higher objective.nll_weight (the SFT term that holds the chosen answers up)")
    # no pairwise knob to name, and no rejected answers the chosen ones follow down ("too")
    assert chosen_logps_drop(history(-1.66, -1.91), 0.1, "sft").endswith(
        "the model is making the held-out answers less likely; try a lower train.learning_rate")
    assert chosen_logps_drop(history(-1.66, -1.91), 0.1, "orpo").endswith(tail + " or orpo.lambda")


def test_under_the_adaptive_schedule_the_remedy_names_the_lambda_it_reads(tmp_path, capsys):
    """orpo.lambda is not read under orpo.lambda_schedule: adaptive (the controller steers lambda up to
    orpo.lambda_max): the warning named it, a change with no effect."""
    tail = "try a lower train.learning_rate or orpo.lambda_max (orpo.lambda is not read under the adaptive schedule)"
    assert chosen_logps_drop(history(-1.66, -1.91), 0.1, "orpo", adaptive=True).endswith(tail)
    run(tmp_path, 0.5, "orpo.lambda_schedule=adaptive", "orpo.lambda_min=5.0", "orpo.lambda_max=5.0")
    logged = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: step")]
    assert logged and all(line.endswith(tail) for line in logged)


def test_only_the_latest_eval_is_judged():
    assert chosen_logps_drop(history(-1.66, -1.91, -1.60), 0.1) is None  # dipped, then recovered
    assert chosen_logps_drop(history(-1.66, -1.56), 0.1) is None  # rose: the healthy case


def test_margin_is_a_strict_bound_and_zero_turns_it_off():
    assert chosen_logps_drop(history(-1.5, -1.75), 0.25) is None  # exactly at the margin (binary fractions)
    assert "0.2500 nats/token below" in chosen_logps_drop(history(-1.5, -1.75), 0.125)
    assert chosen_logps_drop(history(-1.5, -9.0), 0.0) is None


def test_no_step_zero_or_single_eval_means_no_comparison():
    assert chosen_logps_drop({10: {"eval/logps/chosen": -1.0}, 20: {"eval/logps/chosen": -5.0}}, 0.1) is None
    assert chosen_logps_drop(history(-1.0), 0.1) is None
    assert chosen_logps_drop({}, 0.1) is None


def test_random_histories_warn_exactly_when_the_drop_exceeds_the_margin():
    rng = random.Random(0)
    for _ in range(500):
        values = [rng.uniform(-4.0, -0.1) for _ in range(rng.randint(2, 6))]
        margin = rng.choice([0.0, 0.01, 0.1, 0.5, 1.0])
        message = chosen_logps_drop(history(*values), margin)
        drop = values[0] - values[-1]
        assert (message is not None) == (margin > 0 and drop > margin), (values, margin)
        if message:
            assert f"step {10 * (len(values) - 1)}:" in message and f"{drop:.4f} nats/token below" in message


def run(tmp_path, margin, *overrides):
    """A tiny model trained to reject one fixed answer, evaluated on held-out pairs that choose it.

    With a large lambda the odds-ratio term pushes that answer down, so the
    held-out chosen log-probability falls (-6.96 -> -8.14 -> -8.93 nats/token
    at steps 0, 3, 6 with these seeds).
    """
    cfg = load_config(None, [
        f"train.output_dir={tmp_path}", "data.demo_pairs=1", "train.steps=6", "train.global_batch_pairs=4",
        "train.micro_batch_pairs=4", "train.learning_rate=1e-2", "lora.rank=4", "train.progress=false",
        "train.warmup_steps=0", "orpo.lambda=5.0", "train.eval_every=3", f"train.chosen_logps_drop_warn={margin}", *overrides,
    ])
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=None, identity="tiny", source="tiny-llama",
                             reference={"path": "tiny-llama"})
    pairs = [TokenizedPair(p.prompt, p.chosen, [7, 7, 7, 2], p.source) for p in make_pairs(12)]
    held_out = [TokenizedPair(p.prompt, [7, 7, 7, 2], p.chosen, p.source) for p in make_pairs(4, seed=1)]
    dataset = SimpleNamespace(train=pairs, valid=held_out, fingerprint="fp")
    return train(cfg, loaded=loaded, dataset=dataset)


def test_trainer_logs_the_warning_after_each_eval_below_the_margin(tmp_path, capsys):
    result = run(tmp_path / "on", 0.5)
    err = capsys.readouterr().err
    chosen = {s: e["eval/logps/chosen"] for s, e in result.evals.items()}
    assert sorted(chosen) == [0, 3, 6] and chosen[3] < chosen[0] - 0.5 and chosen[6] < chosen[0] - 0.5
    logged = [line for line in err.splitlines() if line.startswith("warning: step")]
    assert logged == [chosen_logps_drop({0: result.evals[0], s: result.evals[s]}, 0.5) for s in (3, 6)]
    assert logged[0].startswith("warning: step 3: ") and logged[1].startswith("warning: step 6: ")


def test_trainer_stays_quiet_when_the_check_is_off(tmp_path, capsys):
    run(tmp_path / "off", 0.0)  # the same run, whose chosen log-probability falls
    assert "eval/logps/chosen" not in capsys.readouterr().err


def test_a_resumed_run_still_compares_with_the_step_zero_eval_of_its_checkpoint(tmp_path, capsys):
    first = run(tmp_path, 0.5, "train.steps=3")
    capsys.readouterr()
    resumed = run(tmp_path, 0.5, "train.resume=auto")  # steps 4-6; step 0 is not evaluated again
    logged = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: step")]
    assert logged == [chosen_logps_drop({0: first.evals[0], 6: resumed.evals[6]}, 0.5)]
    assert f"step-0 value {first.evals[0]['eval/logps/chosen']:.4f}" in logged[0]


def test_a_non_finite_evaluation_is_named_in_a_warning(tmp_path, capsys, monkeypatch):
    """Training skips a non-finite step with a message; a NaN or infinite held-out metric went only to
    TensorBoard (and keep_best passed over the step without a word)."""
    import math

    from dtrain.run import evaluation

    real = evaluation.evaluate

    def poisoned(*args, **kwargs):
        metrics, stopped = real(*args, **kwargs)
        if args[5] == 3:  # the step evaluated
            metrics = {**metrics, "eval/loss": math.nan, "eval/logps/chosen": -math.inf}
        return metrics, stopped

    monkeypatch.setattr(evaluation, "evaluate", poisoned)
    run(tmp_path, 0.0)
    logged = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: step")]
    assert logged == ["warning: step 3: the held-out evaluation is not finite (eval/loss nan, eval/logps/chosen "
                      "-inf); check the held-out pairs (`dtrain data check`) and the model's dtype"]
    assert non_finite_eval({"eval/loss": 0.5, "eval/rewards/accuracies": 1.0}, 3) is None
    assert non_finite_eval({"eval/loss": math.nan}, 3, "sft") == (
        "warning: step 3: the held-out evaluation is not finite (eval/loss nan); check the held-out rows "
        "(`dtrain data check`) and the model's dtype")
