"""N ranks = 1 rank for every objective (ring ranks of tests/dist_worker.py on
loopback, as tests/test_distributed.py does for ORPO), and DPO's reference
log-probabilities identical, bit for bit, whatever the world size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from test_distributed import WORKER, assert_same_as_one_rank, finish, lora, relative_l2, run_cmd, start_ring


def reference_values(out: Path) -> np.ndarray:
    files = [list((out / "run" / "data_cache").glob(f"reference-*-{part}.npz")) for part in ("train", "valid")]
    assert [len(f) for f in files] == [1, 1], files
    return np.concatenate([np.load(f[0])["values"] for f in files])


@pytest.mark.parametrize("kind", ["dpo", "simpo", "sft"])
def test_two_ring_ranks_train_the_same_adapter_as_one_rank(tmp_path, kind):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    done = run_cmd([sys.executable, str(WORKER), str(one), f"objective.kind={kind}", "train.micro_batch_pairs=2"])
    assert done.returncode == 0, done.stderr
    results = finish(start_ring(2, two, f"objective.kind={kind}", "train.micro_batch_pairs=2"), timeout=180)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, err, _ in results]
    assert_same_as_one_rank(two, 2, one, "ring")
    if kind == "dpo":
        assert np.array_equal(reference_values(one), reference_values(two))


@pytest.mark.parametrize("args", [
    # 4 pairs on 3 ranks (2 + 1 + 1), steps across epochs of 7 pairs; λ ramps from the evaluations
    ["train.global_batch_pairs=4", "orpo.lambda_schedule=adaptive", "train.keep_best=eval/log_odds_ratio",
     "train.keep_best_guard=1.0", "train.grad_clip=1.0"],
    # 2 pairs on 3 ranks: rank 2 trains none at every step
    ["objective.kind=dpo", "train.global_batch_pairs=2", "train.keep_best=eval/rewards/margins"],
], ids=["orpo-uneven-adaptive", "dpo-idle-rank"])
def test_three_ranks_with_uneven_shards_keep_the_same_step_and_lambda_path(tmp_path, args):
    """The held-out metrics, the λ controller's path and train.keep_best's step of 3 ranks are a
    one-rank run's, when the global batch does not divide by the world size."""
    one, three = tmp_path / "one", tmp_path / "three"
    one.mkdir()
    args = ["--pairs", "7", "train.steps=4", "train.micro_batch_pairs=1", "train.eval_every=1", *args]
    done = run_cmd([sys.executable, str(WORKER), str(one), *args])
    assert done.returncode == 0, done.stderr
    results = finish(start_ring(3, three, *args), timeout=180)
    assert [rc for rc, _, _ in results] == [0, 0, 0], [err[-2000:] for _, err, _ in results]
    ref, got = json.loads((one / "rank0.json").read_text()), json.loads((three / "rank0.json").read_text())
    assert got["best_step"] == ref["best_step"] is not None
    lam = [h.get("train/lambda") for h in ref["history"]]
    assert [h.get("train/lambda") for h in got["history"]] == lam
    assert "objective.kind=dpo" in args or len(set(lam)) > 1  # the controller moved λ
    np.testing.assert_allclose([h["loss"] for h in got["history"]], [h["loss"] for h in ref["history"]], rtol=1e-5)
    assert sorted(got["evals"]) == sorted(ref["evals"])
    for step, metrics in ref["evals"].items():
        np.testing.assert_allclose([got["evals"][step][k] for k in metrics], list(metrics.values()),
                                   rtol=1e-5, atol=1e-6, err_msg=step)
    assert relative_l2(lora(one), lora(three)) <= 1e-5
