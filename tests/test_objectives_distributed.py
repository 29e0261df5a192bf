"""N ranks = 1 rank for every objective (ring ranks of tests/dist_worker.py on
loopback, as tests/test_distributed.py does for ORPO), and DPO's reference
log-probabilities identical, bit for bit, whatever the world size."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from test_distributed import WORKER, assert_same_as_one_rank, finish, run_cmd, start_ring


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
