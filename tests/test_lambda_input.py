"""λ as an input of the step: the same loss and gradients as a constant λ, no new trace
when it changes, ``train/lambda`` logged, and an adaptive run resumed mid-ramp equal
to an uninterrupted one bit for bit."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import add_random_lora, make_pairs, make_tiny_model
from test_best import run, same, weights
from dtrain.engine import ReferenceEngine, batch_totals
from dtrain.engine.arch import adapter_for
from dtrain.engine.segmented import SegmentedEngine
from dtrain.engine import ORPO
from dtrain.run.tracking import read_scalars


class Counting:
    """An objective that counts calls of its loss: under ``mx.compile`` a call happens only while tracing."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.nll_scope, self.metric_keys = inner.nll_scope, inner.metric_keys

    def loss(self, *args):
        self.calls += 1
        return self.inner.loss(*args)

    def hyper(self):
        return self.inner.hyper()


def lora_model():
    return add_random_lora(make_tiny_model(seed=0), 0)


def engines(objective):
    yield "reference", ReferenceEngine(lora_model(), objective)
    for size in (0, 1):  # one range (a single value_and_grad) and recomputed ranges
        model = lora_model()
        yield f"segmented-{size}", SegmentedEngine(model, adapter_for(model), objective, segment_layers=size,
                                                   prefix_sharing=True)


def flat(grads):
    return dict(tree_flatten(grads))


@pytest.mark.parametrize("lam", [0.1, 0.37])
def test_lambda_input_gives_the_loss_and_gradients_of_the_objectives_own(lam):
    """λ given as the step's hyper input (``Step.hyper``, what the controller sets) equals the
    objective's own λ bit for bit: loss, every metric sum and every gradient."""
    pairs = make_pairs(3)
    objective = ORPO(lam)
    totals = batch_totals(pairs, objective.nll_scope)
    # the same models twice (seeded); the input-fed engines' own λ is another one: only the input counts
    for (name, engine), (_, own) in zip(engines(ORPO(0.9)), engines(objective)):
        given = engine.step(pairs, totals, hyper={"lambda": mx.array(lam, mx.float32)})
        const = own.step(pairs, totals)
        assert mx.array_equal(const.loss, given.loss).item(), name
        for k in const.sums:
            assert float(const.sums[k]) == float(given.sums[k]), (name, k)
        a, b = flat(const.grads), flat(given.grads)
        assert all(mx.array_equal(a[k], b[k]).item() for k in a), name


def test_a_new_lambda_traces_nothing_again():
    """Compiled single pass: the first step traces (the loss runs twice: value_and_grad and
    the metric sums), steps at other λ reuse the trace and still use the new λ."""
    pairs = make_pairs(3)
    model = lora_model()
    objective = Counting(ORPO(0.1))
    engine = SegmentedEngine(model, adapter_for(model), objective, prefix_sharing=True, compile=True)
    eager_model = lora_model()
    eager = SegmentedEngine(eager_model, adapter_for(eager_model), ORPO(0.1), prefix_sharing=True)
    losses = {}
    for lam in (0.1, 0.3, 0.05, 0.3):
        hyper = ORPO(lam).hyper()
        out = engine.step(pairs, batch_totals(pairs, objective.nll_scope), hyper=hyper)
        mx.eval(out.loss, out.grads)
        if lam == 0.1:
            traced = objective.calls
        losses[lam] = float(out.loss)
        want = eager.step(pairs, batch_totals(pairs, "full"), hyper=hyper).loss
        assert float(out.loss) == pytest.approx(float(want), rel=1e-5), lam
    assert traced == 2 and objective.calls == 2
    assert losses[0.1] < losses[0.3] and losses[0.05] < losses[0.1]  # λ weights a positive odds-ratio term


# -- in a run -----------------------------------------------------------------------

def test_adaptive_pinned_to_one_lambda_equals_static(tmp_path):
    """λ_min = λ_max = 0.1: the controller moves nothing, so the run is the static one, bit for bit."""
    static = run(tmp_path / "static", "orpo.lambda=0.1")
    pinned = run(tmp_path / "pinned", "orpo.lambda_schedule=adaptive", "orpo.lambda_min=0.1", "orpo.lambda_max=0.1")
    assert [h["loss"] for h in static.history] == [h["loss"] for h in pinned.history]
    assert [h["train/lambda"] for h in pinned.history] == [mx.array(0.1, mx.float32).item()] * 6  # the step's input
    assert same(weights(tmp_path / "static" / "adapters"), weights(tmp_path / "pinned" / "adapters"))
    assert [v for _, v in read_scalars(static.run_dir)["train/lambda"]] == pytest.approx([0.1] * 6)


RAMP = ("orpo.lambda_schedule=adaptive", "orpo.lambda_epsilon=10", "orpo.lambda_stop_drop=100")


def test_adaptive_resume_mid_ramp_is_bitwise(tmp_path):
    """ε = 10 nats/token: every slope is inside the band, so the controller leaves phase 1
    at the second evaluation and ramps by 0.05 at each one (real evaluations). Cut after
    step 3 (mid-ramp), resume to 6: the λ sequence, the losses and the adapter equal the
    uninterrupted run's bit for bit."""
    whole = run(tmp_path / "whole", *RAMP)
    lams = [h["train/lambda"] for h in whole.history]  # step s trains with λ set by the evaluation after s - 1
    assert lams == pytest.approx([0.05, 0.10, 0.15, 0.20, 0.25, 0.30])
    run(tmp_path / "cut", *RAMP, "train.steps=3")
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-0000003" / "state.json").read_text())
    assert state["lambda_control"]["phase"] == "ramp" and state["lambda_control"]["lam"] == pytest.approx(0.20)
    resumed = run(tmp_path / "cut", *RAMP, "train.resume=auto")
    assert [h["train/lambda"] for h in resumed.history] == lams[3:]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in whole.history[3:]]
    assert resumed.evals == whole.evals
    assert same(weights(tmp_path / "whole" / "adapters"), weights(tmp_path / "cut" / "adapters"))


def test_a_static_resume_of_an_adaptive_run_is_refused_naming_the_key(tmp_path):
    """orpo.lambda_schedule is refused on resume (dtrain/identity.py): the λ a step trains with would change."""
    from dtrain.errors import UserError
    from dtrain.run.checkpoint import RESUME_HINT

    run(tmp_path, *RAMP, "train.steps=3")
    with pytest.raises(UserError) as err:
        run(tmp_path, "train.resume=auto")
    assert str(err.value).startswith(f"resume: {tmp_path}/checkpoints/step-0000003 was made with different settings: "
                                     f"orpo.lambda_schedule: 'adaptive' in the checkpoint, 'static' now")
    assert str(err.value).endswith(RESUME_HINT)
