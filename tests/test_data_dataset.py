"""load_dataset: sources, split, on_bad_row, fingerprint; demo pairs; data check."""

from __future__ import annotations

import json

import pytest

from dtrain.config import DataConfig
from dtrain.data import check_file, demo_pairs, load_dataset, split_rows
from dtrain.data.demo import demo_answer, is_preferred_response
from dtrain.errors import DataError
from dtrain.types import Row

GOOD = [{"prompt": f"What is {i} + 1?", "chosen": f"{i + 1}", "rejected": f"{i + 2}"} for i in range(20)]


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return str(path)


def distinct(n: int) -> list:
    """``n`` rows of distinct prompts (each a prompt group of one)."""
    return [Row(f"Q{i}", "a", "b", source=f"f:{i + 1}") for i in range(n)]


def test_split_is_deterministic_disjoint_and_complete():
    rows = distinct(50)
    train, valid = split_rows(rows, 0.2, seed=3)
    assert (train, valid) == split_rows(rows, 0.2, seed=3)
    assert len(valid) == 10 and set(train).isdisjoint(valid) and sorted(train + valid, key=rows.index) == rows
    assert [rows.index(r) for r in train] == sorted(map(rows.index, train))  # file order kept
    assert [rows.index(r) for r in valid] == sorted(map(rows.index, valid))
    assert split_rows(rows, 0.2, seed=4)[1] != valid
    assert split_rows(rows, 0.0, seed=3) == (rows, [])
    assert len(split_rows(rows[:3], 0.1, seed=0)[1]) == 1  # at least one held-out row


def test_a_split_never_holds_out_every_row(tmp_path, tokenizer):
    """One row at valid_fraction 0.6 rounded to one held-out row of one: the run stopped with "no usable
    training pairs in FILE (0 bad rows, 0 dropped)", about a usable row that the split had taken."""
    for n in range(1, 6):
        for fraction in (0.5, 0.6, 0.9, 0.99):
            train, valid = split_rows(distinct(n), fraction, seed=0)
            assert len(train) >= 1 and sorted(train + valid, key=distinct(n).index) == distinct(n), (n, fraction)
    ds = load_dataset(DataConfig(train=write_jsonl(tmp_path / "t.jsonl", GOOD[:1]), valid_fraction=0.6), tokenizer,
                      seed=0, log=None)
    assert (len(ds.train), len(ds.valid)) == (1, 0)


def test_load_dataset_valid_fraction(tmp_path, tokenizer):
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", GOOD), valid_fraction=0.25)
    ds = load_dataset(cfg, tokenizer, seed=0, log=None)
    again = load_dataset(cfg, tokenizer, seed=0, log=None)
    assert (len(ds.train), len(ds.valid)) == (15, 5) and ds.train == again.train and ds.valid == again.valid
    assert {p.source for p in ds.train}.isdisjoint({p.source for p in ds.valid})
    assert ds.fingerprint == again.fingerprint and len(ds.fingerprint) == 64


def test_load_dataset_train_and_valid_files(tmp_path, tokenizer):
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", GOOD[:12]), valid=write_jsonl(tmp_path / "v.jsonl", GOOD[12:]))
    ds = load_dataset(cfg, tokenizer, seed=0, log=None)
    assert (len(ds.train), len(ds.valid)) == (12, 8) and ds.valid[0].source == f"{tmp_path / 'v.jsonl'}:1"
    write_jsonl(tmp_path / "v.jsonl", GOOD[13:])
    assert load_dataset(cfg, tokenizer, seed=0, log=None).fingerprint != ds.fingerprint


def test_held_out_rows_given_and_none_usable_stop_the_run(tmp_path, tokenizer):
    """data.valid whose every row was bad or dropped trained on with no evaluation and no word beyond '0 valid
    pairs'; the same for an mlx-lm folder's valid.jsonl. A split that rounds to none is not such a case."""
    train = write_jsonl(tmp_path / "t.jsonl", GOOD[:6])
    valid = tmp_path / "v.jsonl"
    valid.write_text("not json\n" + json.dumps({"prompt": "Q", "chosen": "a", "rejected": "a"}) + "\n")
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=train, valid=str(valid)), tokenizer, log=None)
    assert str(err.value) == (f"no usable held-out pairs in {valid} (1 bad rows, 1 dropped: 1 same text): fix its "
                              "rows (dtrain data check lists them), or give other held-out pairs")
    (tmp_path / "m").mkdir()
    write_jsonl(tmp_path / "m/train.jsonl", GOOD[:6])
    write_jsonl(tmp_path / "m/valid.jsonl", [{"prompt": "Q", "chosen": c, "rejected": c} for c in "ab"])
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=str(tmp_path / "m")), tokenizer, log=None)
    assert str(err.value) == (f"no usable held-out pairs in {tmp_path / 'm/valid.jsonl'} (0 bad rows, 2 dropped: 2 same text): "
                              "fix its rows (dtrain data check lists them), or give other held-out pairs")
    assert len(load_dataset(DataConfig(train=train, valid=write_jsonl(tmp_path / "w.jsonl", GOOD[6:7])), tokenizer,
                            log=None).valid) == 1


def test_on_bad_row_skip_logs_count_and_first_rows(tmp_path, tokenizer):
    path = tmp_path / "t.jsonl"
    path.write_text(write_jsonl(path, GOOD[:4]) and path.read_text() + "not json\n" + '{"prompt": "Q", "chosen": "a"}\n')
    logged = []
    ds = load_dataset(DataConfig(train=str(path), valid_fraction=0.0), tokenizer, log=logged.append)
    assert len(ds.train) == 4 and len(ds.report.bad) == 2
    assert logged == [f"2 of 6 rows skipped (bad rows):\n  {path}:5: invalid JSON: Expecting value (column 1)\n"
                      f"  {path}:6: missing field 'rejected'"]


def test_on_bad_row_error_raises_before_training(tmp_path, tokenizer):
    path = tmp_path / "t.jsonl"
    path.write_text(write_jsonl(path, GOOD[:4]) and path.read_text() + '{"prompt": "Q", "chosen": "a", "rejected": "a"}\n'
                    + '{"prompt": "Q", "chosen": "a"}\n')
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=str(path), on_bad_row="error"), tokenizer, log=None)
    # the identical pair is read well and dropped (no preference signal), not a bad row; the stop skips nothing
    assert str(err.value) == (f"{path}:6: missing field 'rejected' (1 bad row(s); data.on_bad_row is 'error')\n"
                              f"  1 of 6 rows bad:\n    {path}:6: missing field 'rejected'")


def test_on_bad_row_error_stops_before_tokenizing(tmp_path):
    """A row that cannot be read stops the run before any row is tokenized; the stop came only after every row
    of train and valid was tokenized (minutes on a large file)."""
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"tokenizer used: {name}")

    path = write_jsonl(tmp_path / "t.jsonl", GOOD[:4] + [{"prompt": "Q", "chosen": "a"}])
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=path, on_bad_row="error"), Untouchable(), log=None)
    assert str(err.value) == (f"{path}:5: missing field 'rejected' (1 bad row(s); data.on_bad_row is 'error')\n"
                              f"  1 of 5 rows bad:\n    {path}:5: missing field 'rejected'")


def test_no_usable_pairs_is_an_error(tmp_path, tokenizer):
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", GOOD[:3]), max_length=4, max_prompt_length=4)
    logged = []
    with pytest.raises(DataError, match=r"no usable training pairs in .*t.jsonl \(0 bad rows, 3 dropped: 3 prompt "
                                        r"too long\)"):
        load_dataset(cfg, tokenizer, log=logged.append)
    assert logged[0].splitlines()[:2] == ["3 of 3 rows dropped (3 prompt too long):", (
        f"  {tmp_path / 't.jsonl'}:1: prompt too long: the system message and the template's structure need 9 tokens; "
        "data.max_prompt_length=4")]


def test_demo_pairs_deterministic_and_prefix_stable():
    assert demo_pairs(50, seed=1) == demo_pairs(50, seed=1)
    assert demo_pairs(20, seed=1) == demo_pairs(50, seed=1)[:20]
    assert demo_pairs(50, seed=1) != demo_pairs(50, seed=2)
    assert demo_pairs(3, seed=0)[0] == {"prompt": "How much is 63 minus 3?", "chosen": "ANSWER: 60",
                                        "rejected": "That would be 59."}


def test_demo_preference_is_verifiable():
    rows = demo_pairs(500, seed=0)
    assert all(is_preferred_response(r["prompt"], r["chosen"]) for r in rows)
    assert not any(is_preferred_response(r["prompt"], r["rejected"]) for r in rows)
    assert len({r["prompt"] for r in rows}) > 400 and len({r["rejected"] for r in rows}) > 300
    assert demo_answer("What is 7 times 6?") == 42 and demo_answer("Compute 9 - 4.") == 5
    with pytest.raises(ValueError):
        demo_answer("Tell me a joke.")


def test_demo_dataset_is_short_and_fingerprinted(tokenizer):
    cfg = DataConfig(demo_pairs=100, demo_seed=0, valid_fraction=0.2)
    ds = load_dataset(cfg, tokenizer, seed=0, log=None)
    assert (len(ds.train), len(ds.valid)) == (80, 20) and ds.report.bad == []
    assert ds.train[0].source.startswith("demo:")
    assert max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in ds.train + ds.valid) <= 64
    assert ds.fingerprint == load_dataset(cfg, tokenizer, seed=0, log=None).fingerprint
    assert ds.fingerprint != load_dataset(DataConfig(demo_pairs=100, demo_seed=1), tokenizer, log=None).fingerprint


def test_check_file_report(tmp_path, tokenizer):
    path = tmp_path / "t.jsonl"
    path.write_text(write_jsonl(path, GOOD[:4]) and path.read_text() + "{oops\n")
    out, n_bad, _ = check_file(str(path), DataConfig(max_length=19), tokenizer)
    assert n_bad == 1
    lines = out.splitlines()
    assert lines[0] == f"{path}: 5 rows, 4 usable, 1 bad, 0 dropped"
    assert lines[2] == f"  {path}:5: invalid JSON: Expecting property name enclosed in double quotes (column 2)"
    assert lines[3] == "4 pairs truncated to data.max_prompt_length / data.max_length"
    assert lines[4] == "token lengths (untruncated, 4 pairs): min / median / p95 / max"
    assert lines[5:8] == ["  prompt   18 / 18 / 18 / 18", "  chosen   2 / 2 / 2 / 2", "  rejected 2 / 2 / 2 / 2"]
    assert lines[-1] == ("limits: max_prompt_length=512, max_length=19: 4 pairs truncated, "
                         "0 of them only because of max_prompt_length")


def test_real_files_tokenize(shared_data, tokenizer):
    # the tiny test vocabulary spells orca's system prompt in 150+ tokens; a smaller limit drops every row
    cfg = DataConfig(train=str(shared_data / "orca_dpo_pairs_validation.jsonl"), max_length=512, max_prompt_length=256)
    ds = load_dataset(cfg, tokenizer, seed=0, log=None)
    assert len(ds.train) + len(ds.valid) == 284 and len(ds.valid) == 28
    assert ds.fingerprint == "21ebe627cbd53a4e5bf214bcb625591b1e4aa8bf07750dde1e4d81050951772f"  # README's sha256
    assert all(len(p.prompt) <= 256 and len(p.prompt) + len(p.chosen) <= 512 for p in ds.train)
    assert all(tokenizer.decode(p.prompt).endswith("<|im_end|>\n<|im_start|>assistant\n") for p in ds.train)
    se = DataConfig(fields={"prompt": "question", "chosen": "response_j", "rejected": "response_k"})
    out, n_bad, _ = check_file(str(shared_data / "stack_exchange_paired_tiny.json"), se, tokenizer)
    assert n_bad == 0
    assert out.splitlines()[0].endswith("stack_exchange_paired_tiny.json: 25 rows, 25 usable, 0 bad, 0 dropped")


def test_a_split_keeps_the_rows_of_a_prompt_on_one_side():
    """data.valid_fraction held out rows one by one, so rows that share a prompt (several pairs per prompt, as in
    UltraFeedback) lay on both sides: held-out accuracy measured prompts trained on, and keep_best chose its step
    by it. It holds out round(G * fraction) of the G distinct prompts (and system messages), picked as rows were
    picked, over the prompts in order of first appearance: without a repeated prompt, the split is the one before."""
    import random

    for n in (2, 3, 10, 50, 101):
        for fraction, seed in ((0.1, 0), (0.25, 3), (0.5, 7)):
            rows = distinct(n)
            picked = set(random.Random(seed).sample(range(n), min(max(round(n * fraction), 1), n - 1)))
            assert split_rows(rows, fraction, seed) == ([r for i, r in enumerate(rows) if i not in picked],
                                                        [r for i, r in enumerate(rows) if i in picked])
    rng = random.Random(11)
    for trial in range(30):
        msgs = [[{"role": "user", "content": f"Q{i}"}] for i in range(6)]
        prompts = [f"Q{i}" for i in range(6)] + msgs + [None, ""]  # no prompt (a text row, empty): a row on its own
        rows = [Row(p, f"a{j}", "b", system=rng.choice([None, "S"]) if p else None, source=f"f:{j + 1}")
                for j, p in enumerate(rng.choice(prompts) for _ in range(rng.randint(2, 40)))]
        as_msgs = lambda p: [{"role": "user", "content": p}] if isinstance(p, str) else p  # noqa: E731
        keys = [repr((r.system, as_msgs(r.prompt))) if r.prompt else r.source for r in rows]  # "Q3" is [user "Q3"]
        groups = list(dict.fromkeys(keys))
        train, valid = split_rows(rows, 0.3, seed=trial)
        assert sorted(train + valid, key=rows.index) == rows
        held = {keys[rows.index(r)] for r in valid}
        assert held.isdisjoint(keys[rows.index(r)] for r in train), trial
        want = min(max(round(len(groups) * 0.3), 1), len(groups) - 1) if len(groups) > 1 else 0
        assert held == {groups[g] for g in random.Random(trial).sample(range(len(groups)), want)}, trial
    assert split_rows([Row("Q", c, "b") for c in "abc"], 0.5, seed=0)[1] == []  # one prompt: none held out


def test_real_stack_exchange_split_holds_out_whole_questions(shared_data, tokenizer):
    """stack_exchange_paired_tiny: 25 pairs of 8 questions; the row split put 6 of its held-out pairs' questions in
    training too."""
    se = DataConfig(train=str(shared_data / "stack_exchange_paired_tiny.json"), valid_fraction=0.25,
                    fields={"prompt": "question", "chosen": "response_j", "rejected": "response_k"})
    ds = load_dataset(se, tokenizer, seed=0, log=None)
    prompt = {p.source: tuple(p.prompt) for p in ds.train + ds.valid}
    held = {prompt[p.source] for p in ds.valid}
    assert len(held) == 2 and held.isdisjoint(prompt[p.source] for p in ds.train)
    assert len(ds.train) + len(ds.valid) == 25


def test_a_dataset_says_whether_its_split_kept_prompts_together(tmp_path, tokenizer):
    """``Dataset.by_prompt``: the rows were split by data.valid_fraction and some share a prompt, so the split is
    not the one an earlier dtrain made of them (by row); the run records it for a resume to compare."""
    shared = write_jsonl(tmp_path / "s.jsonl", [{**g, "chosen": f"{g['chosen']}{c}"} for g in GOOD[:5] for c in "ab"])
    unique = write_jsonl(tmp_path / "u.jsonl", GOOD)
    for cfg, by_prompt in ((DataConfig(train=shared), True), (DataConfig(train=unique), False),
                           (DataConfig(train=shared, valid_fraction=0.0), False),
                           (DataConfig(train=shared, valid=unique), False),
                           (DataConfig(demo_pairs=100), False)):  # demo prompts repeat: split by row
        assert load_dataset(cfg, tokenizer, log=None).by_prompt is by_prompt, cfg


def test_prompts_that_differ_only_by_the_whitespace_around_them_are_one_prompt_in_the_split():
    """A question copied with a trailing newline or a leading space ("What is 5 + 5?" and "What is 5 + 5?\\n", as
    merged datasets hold them) was another prompt: data.valid_fraction could hold out one copy and train on the
    other, the held-out accuracy then measuring a question trained on. The split compares each text (a message's
    content, the system message) without the whitespace around it."""
    from dtrain.data import prompt_groups

    msgs = lambda q: [{"role": "system", "content": "S"}, {"role": "user", "content": q}]  # noqa: E731
    rows = [Row(p, f"a{j}", "b", system=s, source=f"f:{j + 1}") for j, (p, s) in enumerate([
        ("What is 5 + 5?", None), ("What is 5 + 5?\n", None), (" What is 5 + 5? ", None), ("What is 6 + 6?", None),
        ("What is 6 + 6?", "Be brief."), ("What is 6 + 6? ", "Be brief.\n"), (msgs("Q"), None), (msgs("Q\n\n"), None),
        (msgs("Q "), "T"), ("What is 5+5?", None)])]
    assert prompt_groups(rows) == [[0, 1, 2], [3], [4, 5], [6, 7], [8], [9]]
    for seed in range(10):
        train, valid = split_rows(rows, 0.5, seed)
        assert len({r.source for r in valid} & {"f:1", "f:2", "f:3"}) in (0, 3), seed


def test_a_split_by_prompt_that_holds_out_the_rows_a_split_by_row_did_is_not_recorded_as_another(tmp_path, tokenizer):
    """20 rows whose last 4 share a prompt: at seed 0 the prompts held out (2 of 17) are rows 13 and 14, the rows an
    earlier dtrain's row split held out. ``Dataset.by_prompt`` was True wherever prompts repeat, so the run recorded
    'held-out split: by prompt' and the resume of that earlier dtrain's checkpoint, the same pairs trained and held
    out, was refused naming the held-out split; it is recorded where the split differs from the row split."""
    rows = [{"prompt": f"What is {min(i, 16)} + 1?", "chosen": f"{i + 1}", "rejected": f"{i + 5}"} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = load_dataset(DataConfig(train=path), tokenizer, seed=0, log=None)
    assert [p.source for p in ds.valid] == [f"{path}:13", f"{path}:14"]
    parsed = load_dataset(DataConfig(train=path, valid_fraction=0.0), tokenizer, log=None).train
    assert [p.source for p in split_rows(parsed, 0.1, 0, by_prompt=False)[1]] == [f"{path}:13", f"{path}:14"]
    assert ds.by_prompt is False
    assert load_dataset(DataConfig(train=path), tokenizer, seed=1, log=None).by_prompt is True  # rows 5, 19 by row


def test_a_text_prompt_and_the_same_prompt_as_messages_are_one_prompt_in_the_split():
    """A text prompt is rendered as a user turn, and a row's system text as a system message: "Q" and
    [user "Q"] (a file that mixes the standard and conversational formats), or "Q" with system "S" and
    [system "S", user "Q"], train the same prompt, but the split compared them as written, so
    data.valid_fraction could hold out one and train on the other."""
    from dtrain.data import prompt_groups

    user, system = {"role": "user", "content": "Q"}, {"role": "system", "content": "S"}
    rows = [Row(p, f"a{j}", "b", system=s, source=f"f:{j + 1}") for j, (p, s) in enumerate([
        ("Q", None), ([user], None), ("Q", "S"), ([system, user], None), ([system, user], "S"), ([user], "S"),
        ("Q", "T"), ([system, user], "T"), ([{"role": "assistant", "content": "Q"}], None)])]
    assert prompt_groups(rows) == [[0, 1], [2, 3, 4, 5], [6], [7], [8]]
    for seed in range(10):
        valid = {r.source for r in split_rows(rows, 0.5, seed)[1]}
        assert len(valid & {"f:1", "f:2"}) in (0, 2) and len(valid & {"f:3", "f:4", "f:5", "f:6"}) in (0, 4), seed


def test_transcript_prompts_that_differ_only_by_the_whitespace_around_a_turn_are_one_prompt_in_the_split(tmp_path):
    """An HH transcript's turns are rendered stripped ('\\n\\nHuman: What is 5 + 5?\\n\\n\\nAssistant:' trains the
    user turn 'What is 5 + 5?'), but the split compared the transcript's text whole, so a copy with a newline more
    before its Assistant marker was another prompt: data.valid_fraction could hold it out and train on the other."""
    from dtrain.data import load_rows, prompt_groups

    turns = ["\n\nHuman: What is 5 + 5?", "\n\nHuman: What is 5 + 5?\n", "\n\nHuman:  What is 5 + 5? ",
             "\n\nHuman: What is 6 + 6?", "Human: What is 5 + 5?"]
    objs = [{"chosen": f"{t}\n\nAssistant: 10", "rejected": f"{t}\n\nAssistant: {j}"} for j, t in enumerate(turns)]
    rows, report = load_rows(str(write_jsonl(tmp_path / "hh.jsonl", objs)), DataConfig())
    assert len(rows) == 5 and not report.bad
    assert prompt_groups(rows) == [[0, 1, 2, 4], [3]]
    apart = [{"prompt": f"{t}\n\nAssistant:", "chosen": " 10", "rejected": f" {j}"} for j, t in enumerate(turns)]
    rows, report = load_rows(str(write_jsonl(tmp_path / "apart.jsonl", apart)), DataConfig())
    assert len(rows) == 5 and not report.bad
    assert prompt_groups(rows) == [[0, 1, 2, 4], [3]]
