"""Generated cases: the segmented engine, over N ranks and micro-batches, trains as the
reference engine does over one.

Each seed is a case: an architecture and an objective (seeds 0-71: every pairing once), and,
drawn from the seed, a global batch of pairs with edge lengths (a 1-token prompt or response,
chosen == rejected, very unequal sides, responses cut at a ``data.max_length``, rows past
dtrain's attention query block, SFT rows, a pair whose rejected side has its own prompt, pad
id 0 inside the text), a world size and micro-batch size (dividing the batch or not, ranks with
no pairs), the step's hyper-parameters (the objective's own or scaled: step inputs), and the
segmented engine's settings (range size or ``auto``, head chunk, prefix sharing, packing,
length bucket, attention calls, dtrain's kernels, compile) or, one case in ten, the reference
engine itself. The ranks' micro-batches run in-process and are summed as ``Group.all_sum``
sums them; the loss (the summed ``evaluate`` losses and the finalised metric), every metric
sum (step and evaluation), every finalised metric and every LoRA gradient must equal the
reference engine's on the whole batch, in float64.
"""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from dtrain.engine import DPO, ORPO, SFT, ReferenceEngine, SimPO, batch_totals, run_micro_batches
from dtrain.engine.arch import adapter_for
from dtrain.engine.segmented import SegmentedEngine
from dtrain.sampler import micro_batches, shard_batches
from dtrain.types import TokenizedPair

from conftest import add_random_lora, make_tiny_model
from test_engine_gemma4 import GEMMA4
from test_engine_segmented import ARCHS, VOCAB

# float64: with MLX's kernels the forward values differ by summation order only; dtrain's kernels
# compute exp differently (to float32 rounding), and MLX's float64 softmax (attention's backward too)
# rounds as float32 does, which the gradients of two differently shaped graphs show
SUM_TOL = {"mlx": 1e-12, "dtrain": 1e-5}
GRAD_TOL = 2e-5
# gemma3 with a window of 3, far shorter than the sequences; gemma4: two head sizes, layers 4-7 reuse the
# K/V of layers 2 and 3 (donors [2, 3, 2, 3]: with ranges of 1 or 2 layers, a donor's K/V feed two ranges)
MODELS = {**{k: ARCHS[k] for k in ("llama", "mistral", "llama_sliding", "qwen2", "qwen3", "minicpm")},
          "gemma3": (ARCHS["gemma3"][0], dict(ARCHS["gemma3"][1], sliding_window=3)),
          "gemma4": ("gemma4_text", dict(GEMMA4, num_hidden_layers=8, num_kv_shared_layers=4))}
OBJECTIVES = {"orpo": ORPO(0.2), "orpo_response": ORPO(0.7, "response"), "dpo_sigmoid": DPO(0.1),
              "dpo_ipo": DPO(0.5, "ipo"), "dpo_hinge": DPO(0.1, "hinge"), "simpo": SimPO(2.0, 0.5),
              "simpo_nll": SimPO(2.5, 0.3, 0.5), "sft": SFT(), "sft_full": SFT("full")}
CASES = len(MODELS) * len(OBJECTIVES)  # every architecture with every objective
MAX_LENGTH = 14  # tokens of prompt + response per side, as data.max_length cuts them
_models = {}


def model_of(name: str):
    """A float64 tiny random model of ``MODELS[name]`` with random LoRA on every layer (built once)."""
    if name not in _models:
        module, args = MODELS[name]
        model = add_random_lora(make_tiny_model(module, seed=1, **args), seed=1)
        model.set_dtype(mx.float64)
        _models[name] = model
    return _models[name]


def lengths_of(rng: random.Random, kind: str) -> tuple[int, int, int]:
    """``(prompt, chosen, rejected)`` token counts of one pair of edge ``kind``."""
    n = lambda hi: rng.randint(1, hi)  # noqa: E731
    if kind == "cut":  # data.max_length cuts both responses after the prompt (render.py's rule)
        P = n(MAX_LENGTH - 1)
        return P, min(n(20), MAX_LENGTH - P), min(n(20), MAX_LENGTH - P)
    return {"p1": (1, n(9), n(9)), "c1": (n(9), 1, n(9)), "r1": (n(9), n(9), 1), "all1": (1, 1, 1),
            "long_chosen": (n(3), n(6) + 18, n(2)), "long_rejected": (n(3), n(2), n(6) + 18),
            "long_prompt": (n(6) + 18, n(3), n(3)), "any": (n(12), n(12), n(12)),
            # rows past kernels.QUERY_BLOCK (128): dtrain's attention in several query blocks
            "past_block": (n(20) + 100, n(30) + 10, n(30) + 10)}[kind]


KINDS = ("p1", "c1", "r1", "all1", "long_chosen", "long_rejected", "long_prompt", "cut", "any", "any")


def make_batch(rng: random.Random, n: int, objective: str) -> list[TokenizedPair]:
    """``n`` generated pairs; see the module doc for the edge cases drawn."""
    low = 0 if rng.random() < 0.3 else 5  # sometimes token 0 (the layouts' pad id) inside the text
    ids = lambda k: [rng.randrange(low, VOCAB) for _ in range(k)]  # noqa: E731
    pairs = []
    for i in range(n):
        P, C, R = lengths_of(rng, "past_block" if rng.random() < 0.02 else rng.choice(KINDS))  # a few, as they cost
        prompt, chosen = ids(P), ids(C)
        roll = rng.random()
        if roll < 0.15:
            rejected = list(chosen)  # no preference signal (the data layer drops these; the engines must agree)
        elif roll < 0.3:  # a shared start, as two responses cut at max_length often have
            rejected = chosen[: rng.randint(0, C)] + ids(R)
        else:
            rejected = ids(R)
        pair = TokenizedPair(prompt, chosen, rejected, f"g:{i}")
        if rng.random() < 0.2:  # the rejected side renders another prompt: two sequences under prefix sharing
            pair = dataclasses.replace(pair, rejected_prompt=ids(rng.randint(1, 9)))
        if objective.startswith("sft") and rng.random() < 0.6:
            pair = dataclasses.replace(pair, rejected=[], rejected_prompt=None)  # an SFT row
        if objective.startswith("dpo"):
            ref = {"ref_chosen": -rng.uniform(2, 60), "ref_rejected": -rng.uniform(2, 60)}
            pair = dataclasses.replace(pair, extra=ref)
        pairs.append(pair)
    return pairs


@dataclasses.dataclass
class Case:
    arch: str
    objective: str
    pairs: list
    world_size: int
    micro: int
    engine: dict  # SegmentedEngine's keywords; None: the reference engine over the ranks' micro-batches
    own_kernels: bool
    scale: float  # the step's hyper-parameters are the objective's own times this (step inputs)

    def __str__(self):
        spans = [(len(p.prompt), len(p.chosen), len(p.rejected), p.rejected_prompt is not None) for p in self.pairs]
        return (f"{self.arch} {self.objective} W={self.world_size} micro={self.micro} own_kernels={self.own_kernels} "
                f"hyper x{self.scale} {self.engine or 'reference'} (P, C, R, own rejected prompt)={spans}")


def make_case(seed: int) -> Case:
    """Case ``seed``: its architecture and objective by ``seed`` (8 and 9 of them: seeds 0-71 give every
    pairing once), everything else drawn from a generator seeded with it."""
    rng = random.Random(seed)
    arch, objective = list(MODELS)[seed % len(MODELS)], list(OBJECTIVES)[seed % len(OBJECTIVES)]
    n = rng.randint(1, 6)
    engine = dict(segment_layers=rng.choice([0, 1, 2, 3, "auto"]), head_chunk_tokens=rng.choice([0, 1, 3, 7]),
                  prefix_sharing=rng.random() < 0.7, pack=rng.random() < 0.5, length_bucket=rng.choice([0, 0, 4, 8]),
                  attention_groups=rng.choice([1, 2, 4]), compile=rng.random() < 0.2)
    if engine["segment_layers"] == "auto":
        engine["memory_budget"] = rng.choice([1.0, 1e12])  # no plan fits / the single pass fits
    return Case(arch, objective, make_batch(rng, n, objective), rng.randint(1, 3), rng.randint(1, n + 1),
                None if rng.random() < 0.1 else engine, rng.random() < 0.5, rng.choice([1.0, 1.0, 0.5, 3.0]))


def grad_errors(grads: dict, want: dict) -> dict:
    """Per parameter: ``|grad - want| / max(|want|, 1e-3 |all of want|, 1e-6)`` (Frobenius norms), so a
    gradient that is zero up to rounding (chosen == rejected) is compared against the whole tree's."""
    norm = lambda x: float(np.linalg.norm(np.array(x, np.float64)))  # noqa: E731
    floor = max(1e-3 * float(np.sqrt(sum(norm(v) ** 2 for v in want.values()))), 1e-6)
    return {k: norm(np.array(grads[k], np.float64) - np.array(v, np.float64)) / max(norm(v), floor)
            for k, v in want.items()}


def close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def assert_sums(got: dict, want: dict, tol: float, case: Case, skip=()) -> None:
    """Every sum of ``want`` but ``skip`` in ``got`` to ``tol``; ``accuracy_sum`` may differ by the
    pairs whose chosen and rejected sides are the same (a tie that rounding decides, in either engine)."""
    for k, v in want.items():
        if k not in skip:
            assert close(got[k], v, tol) or (k == "accuracy_sum" and abs(got[k] - v) <= ties(case)), \
                (k, got[k], v, str(case))


def ties(case: Case) -> int:
    """Pairs of ``case`` whose chosen and rejected sides are the same tokens after the same prompt."""
    return sum(p.rejected == p.chosen and p.rejected_prompt is None for p in case.pairs)


def over_ranks(engine, case: Case, totals, with_grads: bool, hyper: dict):
    """The step's sums and gradients: every rank's micro-batches, summed over the ranks."""
    sums, grads = None, None
    for rank in range(case.world_size):
        chunks = shard_batches(case.pairs, rank, case.world_size, case.micro)
        s, g = run_micro_batches(engine, chunks, totals, with_grads, None, hyper)
        sums = s if sums is None else {k: sums[k] + v for k, v in s.items()}
        if g is not None:
            grads = g if grads is None else tree_map(lambda a, b: a + b, grads, g)
    return sums, grads


def check(case: Case) -> None:
    """The case's engine over its ranks and micro-batches against the reference engine over the whole batch."""
    model, obj = model_of(case.arch), OBJECTIVES[case.objective]
    engine = (ReferenceEngine(model, obj) if case.engine is None else
              SegmentedEngine(model, adapter_for(model, case.own_kernels), obj, **case.engine))
    totals = batch_totals(case.pairs, obj.nll_scope)
    hyper = {k: v * case.scale for k, v in obj.hyper().items()}
    ref = ReferenceEngine(model, obj).step(case.pairs, totals, None, hyper)
    mx.eval(ref.loss, ref.grads)
    sums, grads = over_ranks(engine, case, totals, True, hyper)
    ref_sums = {k: float(v) for k, v in ref.sums.items()}
    tol = SUM_TOL["dtrain" if case.own_kernels and case.engine else "mlx"]
    assert_sums(sums, ref_sums, tol, case, ("input_tokens", "computed_tokens", "fallback_pairs"))  # layouts differ
    fallback = sum(p.rejected_prompt is not None and bool(p.rejected) for p in case.pairs)
    assert sums["fallback_pairs"] == (fallback if case.engine and case.engine["prefix_sharing"] else 0), str(case)
    want, got = obj.finalize(ref_sums, "", hyper), obj.finalize(sums, "", hyper)
    assert close(float(ref.loss), want["loss"], tol), (float(ref.loss), want["loss"], str(case))
    for k, v in want.items():  # the metrics of the same sums: only accuracy may differ, by the ties
        tied = k == "rewards/accuracies" and abs(got[k] - v) * len(case.pairs) <= ties(case)
        assert close(got[k], v, tol) or tied, (k, got[k], v, str(case))
    g_ref, g_out = dict(tree_flatten(ref.grads)), dict(tree_flatten(grads))
    assert g_ref.keys() == g_out.keys()
    errors = grad_errors(g_out, g_ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRAD_TOL, (worst, errors[worst], str(case))
    # evaluation: the summed loss contributions and metric sums of every micro-batch of every rank
    loss = sum(float(engine.evaluate(chunk, totals, None, hyper).loss) for rank in range(case.world_size)
               for chunk in shard_batches(case.pairs, rank, case.world_size, case.micro))
    assert close(loss, float(ref.loss), tol), (loss, float(ref.loss), str(case))
    assert_sums(over_ranks(engine, case, totals, False, hyper)[0], sums, tol, case)


@pytest.mark.parametrize("seed", range(CASES))
def test_generated_cases_train_as_the_reference_engine_on_one_rank(seed):
    check(make_case(seed))


DROPOUT_CASES = 12
_dropout_models = {}


def dropout_model(name: str):
    """``model_of(name)``'s float64 model with LoRA dropout 0.3 on every layer (random LoRA weights), built once."""
    if name not in _dropout_models:
        from mlx_lm.tuner.utils import linear_to_lora_layers

        module, args = MODELS[name]
        model = make_tiny_model(module, seed=1, **args)
        model.freeze()
        linear_to_lora_layers(model, len(model.layers), {"rank": 4, "scale": 2.0, "dropout": 0.3})
        mx.random.seed(2)
        model.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), model.trainable_parameters()))
        model.set_dtype(mx.float64)
        model.train()
        _dropout_models[name] = model
    return _dropout_models[name]


@pytest.mark.parametrize("seed", range(DROPOUT_CASES))
def test_generated_cases_with_lora_dropout_draw_the_reference_engines_masks(seed):
    """LoRA dropout on: over the same micro-batches and one step key (split per micro-batch), the
    segmented engine on the reference's layout (two padded sequences per pair, exact shapes) draws
    its masks range by range and again in each recompute, so loss, sums and gradients are the
    reference engine's; another key gives other log-probabilities."""
    case = make_case(1000 + seed)
    name = ("llama", "qwen3", "gemma3", "minicpm")[seed % 4]
    model, obj = dropout_model(name), OBJECTIVES[case.objective]
    engine = SegmentedEngine(model, adapter_for(model, case.own_kernels), obj,
                             **{**(case.engine or {}), "prefix_sharing": False, "pack": False, "length_bucket": 0,
                                "compile": False})
    chunks = micro_batches(case.pairs, case.micro)
    totals, key = batch_totals(case.pairs, obj.nll_scope), mx.random.key(seed)
    (ref_sums, ref_grads), (sums, grads) = (run_micro_batches(e, chunks, totals, True, key)
                                            for e in (ReferenceEngine(model, obj), engine))
    assert_sums(sums, ref_sums, SUM_TOL["dtrain" if case.own_kernels else "mlx"], case)
    errors = grad_errors(dict(tree_flatten(grads)), dict(tree_flatten(ref_grads)))
    assert max(errors.values()) < GRAD_TOL, (max(errors, key=errors.get), max(errors.values()), name, str(case))
    other, _ = run_micro_batches(engine, chunks, totals, False, mx.random.key(seed + 100))
    assert not close(other["logps_chosen_sum"], sums["logps_chosen_sum"], 1e-6)  # other masks: dropout is on
