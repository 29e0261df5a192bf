"""dtrain.sampler: exact batches at epoch boundaries, no pair twice in a step,
every pair once per epoch, disjoint rank shards, and resume from the step alone."""

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain import sampler
from dtrain.sampler import Sampler, epoch_permutation, global_batch


def pairs_of(step, n, b, seed=0):
    return [i for _, i in global_batch(step, n, b, seed)]


def test_the_raw_permutations_behind_the_examples():
    # numpy's seeded permutations; concatenated as they are, 5 pairs with batch 2
    # would give step 3 = [1, 1] and 7 pairs with batch 3 step 3 = [1, 1, 3]
    assert epoch_permutation(5, 0, 0).tolist() == [2, 4, 3, 0, 1]
    assert epoch_permutation(5, 0, 1).tolist() == [1, 4, 3, 0, 2]
    assert epoch_permutation(7, 0, 0).tolist() == [2, 4, 3, 6, 5, 0, 1]
    assert epoch_permutation(7, 0, 1).tolist() == [1, 3, 6, 0, 4, 2, 5]


def test_five_pairs_batch_two_never_repeats_a_pair_in_a_step():
    # epoch 1 = [1, 4, 3, 0, 2] repaired: its first pair may not be 1 (epoch 0's tail) -> [4, 1, 3, 0, 2]
    assert [pairs_of(s, 5, 2) for s in range(1, 6)] == [[2, 4], [3, 0], [1, 4], [1, 3], [0, 2]]
    assert Sampler(5, 2, 0).epoch_order(1).tolist() == [4, 1, 3, 0, 2]
    # epoch 2 opens on a step boundary (10 % 2 == 0): its raw permutation, untouched
    assert Sampler(5, 2, 0).epoch_order(2).tolist() == epoch_permutation(5, 0, 2).tolist()


def test_seven_pairs_batch_three_on_two_ranks():
    # epoch 1 = [1, 3, 6, 0, 4, 2, 5]; step 3 takes 2 of it, not 1 -> [3, 6], then 1, 0, 4, 2, 5
    assert [pairs_of(s, 7, 3) for s in range(1, 5)] == [[2, 4, 3], [6, 5, 0], [1, 3, 6], [1, 0, 4]]
    step3 = pairs_of(3, 7, 3)
    assert sampler.rank_shard(step3, 0, 2) == [1, 6] and sampler.rank_shard(step3, 1, 2) == [3]


def test_position_after_a_step():
    assert Sampler(5, 2, 0).position(3) == {"epoch": 1, "cursor": 1, "shuffle_seed": 0, "next_pairs": [1, 3]}
    assert Sampler(5, 2, 0).position(0)["next_pairs"] == [2, 4]


def test_a_batch_larger_than_the_pairs_is_refused():
    with pytest.raises(ValueError, match=r"need 1 <= global_batch_pairs <= pairs \(global_batch_pairs=8, pairs=1\)"):
        Sampler(1, 8, 0)
    with pytest.raises(ValueError, match="steps count from 1"):
        Sampler(3, 2, 0).global_batch(0)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 40), data=st.data(), world=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_every_step_and_epoch_over_generated_settings(n, data, world, seed):
    b = data.draw(st.integers(1, n), label="global_batch_pairs")
    epochs = data.draw(st.integers(1, 6), label="epochs")
    steps = -(-epochs * n // b)  # enough steps to cover the epochs
    s = Sampler(n, b, seed)
    batches = [s.global_batch(step) for step in range(1, steps + 1)]
    stream = [i for batch in batches for _, i in batch]
    for step, batch in enumerate(batches, 1):
        ids = [i for _, i in batch]
        assert len(set(ids)) == len(ids) == b, (step, ids)  # no pair twice within a step
        shards = [sampler.rank_shard(ids, r, world) for r in range(world)]
        assert sorted(sum(shards, [])) == sorted(ids)  # disjoint shards covering the batch
    for e in range(len(stream) // n):  # every complete epoch holds every pair once
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n)), e
    # resume: any step computed alone (fresh sampler, module function) equals the sequential one
    for step in data.draw(st.lists(st.integers(1, steps), max_size=5), label="resume steps"):
        assert Sampler(n, b, seed).global_batch(step) == batches[step - 1]
        assert global_batch(step, n, b, seed) == batches[step - 1]


def test_uses_per_pair_over_whole_epochs_are_equal():
    uses = collections.Counter(i for step in range(1, 36) for i in pairs_of(step, 7, 5, seed=3))
    assert uses == {i: 25 for i in range(7)}  # 35 steps x 5 pairs = 25 epochs of 7


@pytest.mark.parametrize("n,world,micro", [(0, 1, 2), (1, 3, 2), (7, 1, 2), (7, 2, 2), (12, 3, 4), (13, 4, 3)])
def test_dealt_batches_cut_the_whole_list_then_deal_the_batches_to_ranks(n, world, micro):
    items = list(range(n))
    got = [sampler.dealt_batches(items, r, world, micro) for r in range(world)]
    whole = sampler.micro_batches(items, micro)
    assert [b for r in range(world) for b in got[r]] == [b for r in range(world) for b in whole[r::world]]
    assert sorted(x for batches in got for b in batches for x in b) == items  # each item once
    assert all(b in whole for batches in got for b in batches)  # the same batches at every world size


@pytest.mark.parametrize("data,said", [
    (["data.valid_fraction=0.2"], " (after the held-out split, data.valid_fraction=0.2)"),
    (["data.valid=v.jsonl"], ""),
    (["data.valid_split=test"], ""),
])
def test_fewer_pairs_than_a_step_names_the_fraction_only_where_it_split_them(data, said):
    """The held-out pairs of data.valid (or data.valid_split) do not come from data.train's pairs."""
    from dtrain.config import load_config
    from dtrain.errors import UserError

    cfg = load_config(None, ["data.train=t.jsonl", "train.global_batch_pairs=4", *data])
    with pytest.raises(UserError) as err:
        sampler.for_run(cfg, [object()] * 3)
    assert str(err.value) == (f"train.global_batch_pairs is 4 but t.jsonl has 3 training pair(s){said}; a step "
                              "would train a pair more than once: set train.global_batch_pairs to at most 3, or add "
                              "data")


def test_fewer_sft_rows_than_a_step_are_called_rows():
    from dtrain.config import load_config
    from dtrain.errors import UserError

    cfg = load_config(None, ["data.train=t.jsonl", "train.global_batch_pairs=4", "objective.kind=sft"])
    with pytest.raises(UserError) as err:
        sampler.for_run(cfg, [object()] * 3)
    assert str(err.value) == ("train.global_batch_pairs is 4 but t.jsonl has 3 training row(s) (after the held-out "
                              "split, data.valid_fraction=0.1); a step would train a row more than once: set "
                              "train.global_batch_pairs to at most 3, or add data")
    with pytest.raises(UserError) as err:
        sampler.for_run(cfg, [])
    assert str(err.value) == "no training rows left after loading and filtering t.jsonl"


def test_fewer_pairs_than_a_step_in_an_mlx_lm_folder_does_not_name_the_fraction(tmp_path):
    """An mlx-lm data folder's valid.jsonl holds the held-out pairs (data.sources.resolve_pair): the
    training pairs are all of train.jsonl, and data.valid_fraction split none of them."""
    from dtrain.config import load_config
    from dtrain.errors import UserError

    for name in ("train.jsonl", "valid.jsonl"):
        (tmp_path / name).write_text("")
    cfg = load_config(None, [f"data.train={tmp_path}", "train.global_batch_pairs=4"])
    with pytest.raises(UserError) as err:
        sampler.for_run(cfg, [object()] * 3)
    assert str(err.value) == (f"train.global_batch_pairs is 4 but {tmp_path} has 3 training pair(s); a step would "
                              "train a pair more than once: set train.global_batch_pairs to at most 3, or add data")
