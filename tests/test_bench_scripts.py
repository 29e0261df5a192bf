"""Command lines of bench/ scripts, run as separate processes: nothing from bench/ is imported
(tests/test_bench_surface.py), and nothing here times anything.

- ``peer.py`` reads mlx-lm-lora's report lines; a step printed at ``tok/s 0.000`` (it did so on a
  pair that carried no signal) is recorded without a time instead of dividing by zero, and the
  summary leaves it out of the figures and counts it.
- ``trl_peer.py`` (TRL's ORPOTrainer, for a CUDA machine) parses its arguments without torch.
- ``tokenize_rate.py`` names the BLAS once in its machine line.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def bench(script: str, *args, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT.joinpath("bench", script)), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=300)


def iter_line(it: int, it_s: str, tok_s: str, loss: str = "0.693") -> str:
    return (f"Iter {it}: loss {loss}, chosen_r -1.200, rejected_r -1.300, accuracies 1.000, margins 0.100, "
            f"learning_rate 2.000e-04, it/s {it_s}, tok/s {tok_s}, peak_mem 1.234GB")


def test_peer_records_a_step_at_zero_tokens_per_second(tmp_path):
    log = tmp_path / "peer.log"
    log.write_text("Starting training..., iters: 3\n" + "\n".join([
        iter_line(1, "0.512", "128.000"),
        iter_line(2, "0.000", "0.000", loss="0.000"),  # the crash: 0 / tok/s
        iter_line(3, "1.250", "50.000"),
    ]) + "\n")
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"drawn": [4, 0, 2], "tokens": [64, 0, 25], "fuse_s": None}))
    out = bench("peer.py", "--peer-log", log, record)
    assert out.returncode == 0, out.stderr
    steps = json.loads(out.stdout)
    assert [(s["step"], s["pair"], s["seconds"], s["zero_rate"]) for s in steps] == [
        (1, 4, 64 / 128, False), (2, 0, None, True), (3, 2, 25 / 50, False)]
    assert steps[1]["seconds_from_it_s"] is None and steps[0]["seconds_from_it_s"] == 1 / 0.512

    # the summary of such a run: the timed steps only, the other counted
    def run(tool, steps):
        return {"tool": tool, "steps": steps, "peak_gb": 1.0, "max_rss_gb": 2.0, "first_row": 0, "fuse_s": 1.0,
                "adapter": {"changed": True}}

    dtrain = [{"step": i + 1, "pair": p, "seconds": s} for i, (p, s) in enumerate([(4, 0.25), (0, 0.2), (2, 0.1)])]
    results = tmp_path / "peer-1.json"
    results.write_text(json.dumps({"runs": [run("dtrain one range+prefix", dtrain), run("mlx-lm-lora", steps)]}))
    out = bench("peer.py", "--table", results)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| mlx-lm-lora "))
    assert row.startswith("| mlx-lm-lora | 2 (+1 at tok/s 0) | 0.50 (0.50–0.50) |")
    # pair by pair against the peer: pairs 4 (0.5 / 0.25) and 2 (0.5 / 0.1); pair 0 has no peer time
    assert "| 3.50 (2.00–5.00, 2) |" in next(line for line in out.stdout.splitlines() if line.startswith("| dtrain "))


def test_peer_reads_generated_report_lines(tmp_path):
    """Any mix of timed and zero-rate lines: a time exactly when tok/s > 0, in order."""
    rng = random.Random(0)
    n = 40
    tok_s = [rng.choice(["0.000", f"{rng.uniform(0.001, 900):.3f}"]) for _ in range(n)]
    tokens = [rng.randint(0, 300) for _ in range(n)]
    (tmp_path / "log").write_text("\n".join(iter_line(i + 1, "0.100", t) for i, t in enumerate(tok_s)))
    (tmp_path / "rec").write_text(json.dumps({"drawn": list(range(n)), "tokens": tokens}))
    out = bench("peer.py", "--peer-log", tmp_path / "log", tmp_path / "rec")
    assert out.returncode == 0, out.stderr
    want = [None if t == "0.000" else k / float(t) for t, k in zip(tok_s, tokens)]
    assert [s["seconds"] for s in json.loads(out.stdout)] == want


def test_trl_peer_parses_its_arguments_without_torch():
    out = bench("trl_peer.py", "--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--data", "--model", "--max-length", "--max-prompt-length", "--lora-rank", "--lora-alpha",
                 "--target-modules", "--batch", "--steps", "--dtype"):
        assert flag in out.stdout, flag
    out = bench("trl_peer.py", "--data", "x.jsonl", "--model", "m", "--steps", "1", "--skip-first", "1")
    assert out.returncode == 2 and "--steps 1 leaves no step after --skip-first 1" in out.stderr
    out = bench("peer.py", "--only", "trl ORPOTrainer", "--trl-python", "")
    assert out.returncode == 2 and "'trl ORPOTrainer' needs --trl-python (or $TRL_PYTHON)" in out.stderr


def test_launch_overhead_reads_the_processes_from_ps_where_there_is_no_proc(tmp_path):
    """macOS has no /proc: the CPU time of the launcher's processes comes from ``ps`` there. The script runs
    with /proc hidden from it (``Path('/proc')`` reads as missing), timing mlx.launch over ranks that sleep."""
    code = ("import pathlib, runpy, sys\n"
            "P, missing = pathlib.Path, lambda *_: (_ for _ in ()).throw(FileNotFoundError(2, 'absent', '/proc'))\n"
            "is_dir, iterdir = P.is_dir, P.iterdir\n"
            "P.is_dir = lambda self, *a, **k: str(self) != '/proc' and is_dir(self, *a, **k)\n"
            "P.iterdir = lambda self: missing() if str(self) == '/proc' else iterdir(self)\n"
            f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
            f"sys.argv = ['launch_overhead.py', '--modes', 'mlx-launch-idle', '--idle-s', '2', '--out', {str(tmp_path)!r}]\n"
            f"runpy.run_path({str(ROOT / 'bench' / 'launch_overhead.py')!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row, = json.loads(next(tmp_path.glob("launch_overhead*.json")).read_text())["rows"]
    assert row["exit"] == 0 and row["wall_s"] >= 2
    assert any("mlx.launch" in cmd for _, cmd in row["launcher_processes"]), row
    assert row["trainers_cpu_s"] == 0, row  # procps shows whole seconds: mlx.launch may show 0 here


def test_tokenize_rate_names_the_blas_once():
    """The summary's machine line ends with the BLAS line as dtrain prints it (``BLAS: OpenBLAS ...``),
    not with a second ``BLAS:`` in front of it."""
    out = bench("tokenize_rate.py", "--rows", "20")
    assert out.returncode == 0, out.stderr[-3000:]
    written = [line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("wrote ")]
    for path in written:
        Path(path).unlink()
    line, = [line for line in out.stdout.splitlines() if line.startswith("machine: ")]
    # not a count of "BLAS:": the reference BLAS's line holds two ("BLAS: MLX's bundled reference BLAS: 5.9 GFLOP/s")
    assert line.count(", BLAS: ") == 1 and "BLAS: BLAS:" not in line, line


def test_the_gpu_engines_smoke_runs_against_the_engines_as_they_are():
    """``bash bench/gpu.sh engines OUT`` (docs/gpu.md) starts with a segmented = reference smoke in
    Python; it built ``ReferenceEngine(m, 0.1)`` after engines took an objective, and printed a
    traceback instead of the comparison. Run here on the CPU (its GPU matmul rate is skipped there)."""
    text = (ROOT / "bench" / "gpu.sh").read_text()
    smoke = text.split("\nengines)\n", 1)[1].split("<<'PY'", 1)[1].split("\n", 1)[1].split("\nPY\n", 1)[0]
    r = subprocess.run([sys.executable, "-c", smoke], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    worst = float(r.stdout.split("worst relative L2 gradient difference ")[1].split()[0])
    assert worst < 1e-4, r.stdout


def write_preference_files(folder: Path) -> None:
    """The two files the sweeps read from their data folder, a few rows each (orca's format, stack's fields)."""
    folder.mkdir()
    row = {"input": {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
           "preferred_output": [{"role": "assistant", "content": "4"}],
           "non_preferred_output": [{"role": "assistant", "content": "5"}]}
    (folder / "orca_dpo_pairs_validation.jsonl").write_text((json.dumps(row) + "\n") * 8)
    rows = [{"question": f"question {q}", "response_j": "yes", "response_k": "no"} for q in range(6) for _ in range(2)]
    (folder / "stack_exchange_paired_tiny.json").write_text(json.dumps(rows))


def test_the_sweeps_read_relative_paths_from_where_they_were_started(tmp_path):
    """``sweep.py run`` and ``lambda_sweep.py run`` start each run in its own folder: a relative ``--data-dir``
    (the default ``./data`` too), ``--model`` or ``--extra`` FILE was read from there, so every orca run stopped
    at 'data file not found'. Each run's config names files that exist as seen from the run's folder. The runs
    fail at once (the model folder is empty); only their configs are read here."""
    write_preference_files(tmp_path / "pairs")
    (tmp_path / "model").mkdir()
    quick = ["--model", "model", "--steps", "2", "--workers", "2", "--budget-s", "300", "--first-guess-s", "1"]
    out = bench("sweep.py", "run", "sweep", "--data-dir", "pairs", "--datasets", "orca", "stack", "--grid", "cpu",
                *quick, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    out = bench("lambda_sweep.py", "run", "lambda", "--data-dir", "pairs", "--datasets", "orca", "--arms", "lam0.1",
                "--seeds", "0", "--extra", "mine=pairs/orca_dpo_pairs_validation.jsonl", *quick, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    configs = sorted(tmp_path.glob("*/runs/**/config.yaml"))
    assert len(configs) == 6, configs  # 2 settings x 2 datasets; 1 arm x (orca, mine)
    for config in configs:
        cfg = yaml.safe_load(config.read_text())
        named = [cfg["model"]["path"], *(cfg["data"][k] for k in ("train", "valid") if cfg["data"].get(k))]
        assert all((config.parent / path).exists() for path in named), (config, named)


def test_a_missing_data_file_is_one_line_naming_it(tmp_path):
    """Real pairs are not in the repository: where ``$DTRAIN_DATA_DIR`` (default ./data) or ``--data`` names no
    file, each script that reads them stops with argparse's one line naming the file and the way to give it; it
    printed a traceback (FileNotFoundError, DataError). The sweeps' demo pairs need no file."""
    env = {**os.environ, "DTRAIN_DATA_DIR": str(tmp_path / "absent")}
    for script, args, name in [
            ("padding.py", [], "orca_dpo_pairs_validation.jsonl"),
            ("peer.py", ["--only", "dtrain auto"], "orca_dpo_pairs_validation.jsonl"),
            ("breakdown.py", ["--layers", "2"], "orca_dpo_pairs_validation.jsonl"),
            ("objectives.py", ["split", tmp_path / "objectives"], "orca_dpo_pairs_validation.jsonl"),
            ("sweep.py", ["run", tmp_path / "sweep", "--datasets", "orca"], "orca_dpo_pairs_validation.jsonl"),
            ("sweep.py", ["run", tmp_path / "sweep", "--datasets", "stack"], "stack_exchange_paired_tiny.json"),
            ("lambda_sweep.py", ["run", tmp_path / "lambda", "--datasets", "demo", "--extra", f"x={tmp_path / 'x.jsonl'}"],
             "x.jsonl")]:
        out = bench(script, *args, env=env)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (script, out.stderr[-3000:])
        line = out.stderr.strip().splitlines()[-1]
        assert line.split(": error: ")[0].split()[0] == script and name in line and "DTRAIN_DATA_DIR" in line, line
    out = bench("sweep.py", "run", tmp_path / "demo", "--datasets", "demo", "--budget-s", "0", env=env)
    assert out.returncode == 0 and "not run (budget): demo/centre" in out.stdout, out.stderr[-3000:]


def test_only_takes_the_names_it_runs():
    """``--only`` of peer.py and engines.py took any name: a misspelt one ran nothing and wrote an empty table
    without a word. A name that is not a tool or engine is refused in argparse's line, naming the choices."""
    for script, args, bad in [("peer.py", ["--only", "dtrain one range + prefix", "mlx-lm-lora"], "dtrain one range + prefix"),
                              ("engines.py", ["--only", "reference", "one-range"], "one-range")]:
        out = bench(script, *args)
        line = out.stderr.strip().splitlines()[-1]
        assert out.returncode == 2 and f"argument --only: invalid choice: '{bad}'" in line, out.stderr[-3000:]
    out = bench("peer.py", "--only", "dtrain one range+prefix", "--pairs-per-run", "3", "--pairs-per-step", "2")
    assert out.returncode == 2 and "--pairs-per-run 3 is not a multiple of --pairs-per-step 2" in out.stderr


def test_the_sweeps_and_objectives_refuse_unknown_names(tmp_path):
    """A dataset the sweeps do not know (``--datasets orka``) stopped at a KeyError once its first run was due,
    and ``objectives.py run --kinds kto`` (or ``dpo-lrX``) after tokenizing the split: both are argparse's line."""
    for script, args, bad in [("sweep.py", ["run", tmp_path, "--datasets", "orka"], "argument --datasets: invalid choice: 'orka'"),
                              ("lambda_sweep.py", ["run", tmp_path, "--datasets", "demos"], "argument --datasets: invalid choice: 'demos'"),
                              ("objectives.py", ["run", tmp_path, "--kinds", "dpo", "kto"], "argument --kinds: 'kto' is not"),
                              ("objectives.py", ["run", tmp_path, "--kinds", "dpo-lrX"], "argument --kinds: 'dpo-lrX' is not")]:
        out = bench(script, *args)
        assert out.returncode == 2 and bad in out.stderr.strip().splitlines()[-1], (script, out.stderr[-3000:])
    assert not list(tmp_path.iterdir())


def test_peer_refuses_rows_past_the_end_of_its_data(tmp_path):
    """``--start``, ``--pairs-per-run`` and ``--rounds`` past the last row of ``--data`` trained on fewer pairs
    than asked (or on none, each tool then failing on an empty file) and reported them as the full run."""
    write_preference_files(tmp_path / "pairs")
    data = tmp_path / "pairs" / "orca_dpo_pairs_validation.jsonl"  # 8 rows
    out = bench("peer.py", "--data", data, "--start", "4", "--pairs-per-run", "3", "--rounds", "2", "--only", "dtrain auto")
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].endswith(
        f"error: --start 4, --pairs-per-run 3 and --rounds 2 need rows 4–9 of {data}, which has 8 (rows 0–7)")


def test_breakdown_names_a_missing_tokenizer_folder(tmp_path):
    """breakdown.py tokenizes with the converted demo model's tokenizer (``--tokenizer-dir``); where that folder
    was not there it printed huggingface_hub's traceback ('Repo id must be a string')."""
    write_preference_files(tmp_path / "pairs")
    folder = tmp_path / "absent"
    out = bench("breakdown.py", "--data", tmp_path / "pairs" / "orca_dpo_pairs_validation.jsonl", "--tokenizer-dir", folder)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"breakdown.py: error: --tokenizer-dir {folder}: no such folder") and "bench/peer.py" in line
