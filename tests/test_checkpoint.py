"""Checkpoints and resume: SIGKILL/SIGINT then `resume: auto` equals an
uninterrupted run bitwise; corrupt checkpoints are skipped; incompatible ones
refused; TensorBoard continues without duplicated steps."""

import errno
import fcntl
import json
import os
import pty
import random
import shutil
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import mlx.core as mx
import pytest

from dtrain.run import checkpoint as ckpt, output
from dtrain.errors import UserError
from dtrain.run.tracking import read_scalars
from waiting import finish as finish_proc, spawn, wait_for_path, wait_until

WORKER = Path(__file__).resolve().parent / "train_worker.py"
TIMING = {"tokens_per_second", "pairs_per_second", "peak_memory_gb"}


def start(out, *overrides, delay=0.0, hold_at=None):
    """The worker training into ``out``; ``delay``: seconds added to each step; ``hold_at``: step N waits
    inside itself, after touching ``out/in-step-N``, until ``out/go-N`` exists (tests/train_worker.py)."""
    env = dict(os.environ)
    if delay:
        env["WORKER_STEP_DELAY"] = str(delay)
    if hold_at is not None:
        env["WORKER_HOLD_AT"] = str(hold_at)
    Path(out).mkdir(parents=True, exist_ok=True)
    return spawn([sys.executable, WORKER, out, *overrides], Path(out).parent / f"{Path(out).name}-logs",
                 f"worker-{time.monotonic_ns()}", env=env)


def stopped_in(proc, out, step, sig):
    """Wait until ``proc`` is inside ``step`` (held there), send ``sig``, let the step go on."""
    wait_for_path(Path(out) / f"in-step-{step}", proc)
    proc.send_signal(sig)
    (Path(out) / f"go-{step}").touch()


def finish(out, *overrides):
    code, _, err = finish_proc(start(out, *overrides))
    assert code == 0, err
    return json.loads((Path(out) / "result-rank0.json").read_text())


def newest_step(out) -> int:
    """The newest checkpoint's step (0 when none): pruned checkpoints come and go, this only grows."""
    found = ckpt.list_checkpoints(Path(out) / "checkpoints") if (Path(out) / "checkpoints").is_dir() else []
    return max((int(p.name.split("-")[1]) for p in found if (p / "manifest.json").exists()), default=0)


def adapters_equal(a, b):
    wa, wb = mx.load(str(Path(a) / "adapters.safetensors")), mx.load(str(Path(b) / "adapters.safetensors"))
    return wa.keys() == wb.keys() and all(mx.array_equal(wa[k], wb[k]).item() for k in wa)


def untimed(history):
    return [{k: v for k, v in h.items() if k not in TIMING and not k.startswith("perf/")} for h in history]


ARGS = ("--train.steps", "8", "--train.save_every", "3", "--train.eval_every", "4")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return out, finish(out, *ARGS)


def test_sigkill_then_resume_is_bitwise_identical(tmp_path, uninterrupted):
    whole_dir, whole = uninterrupted
    proc = start(tmp_path, *ARGS, hold_at=5)
    stopped_in(proc, tmp_path, 5, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "result-rank0.json").exists()
    newest = ckpt.find_latest(tmp_path / "checkpoints")
    resumed_from = int(newest.name.split("-")[1])
    assert resumed_from == 3
    # the event file was on disk before the checkpoint was complete: every step it covers survived the kill
    killed_run = next((tmp_path / "tb").iterdir())
    assert [s for s, _ in read_scalars(killed_run)["loss"]][:resumed_from] == list(range(1, resumed_from + 1))
    resumed = finish(tmp_path, *ARGS, "--train.resume", "auto")
    assert adapters_equal(resumed["adapter_dir"], whole["adapter_dir"])
    # identical logged metrics from the first resumed step on
    assert untimed(resumed["history"]) == untimed(whole["history"][resumed_from:])
    assert resumed["evals"]["8"] == whole["evals"]["8"]
    # TensorBoard: one run folder, every step exactly once, in order
    scalars = read_scalars(Path(resumed["run_dir"]))
    assert [s for s, _ in scalars["loss"]] == list(range(1, 9))
    whole_loss = [v for _, v in read_scalars(Path(whole["run_dir"]))["loss"]]
    assert [v for _, v in scalars["loss"]] == whole_loss


def test_sigkill_right_after_the_first_checkpoint_keeps_what_it_covers(tmp_path, uninterrupted):
    """The event file is flushed (and fsynced) before a checkpoint is complete:
    killed while step 2 runs, the file holds step 0's eval and step 1's scalars."""
    _, whole = uninterrupted
    proc = start(tmp_path, *ARGS, "--train.save_every", "1", hold_at=2)
    stopped_in(proc, tmp_path, 2, signal.SIGKILL)
    proc.wait()
    scalars = read_scalars(next((tmp_path / "tb").iterdir()))
    assert scalars["loss"] == [(1, pytest.approx(whole["history"][0]["loss"], rel=1e-6))]
    assert scalars["eval/loss"] == [(0, pytest.approx(whole["evals"]["0"]["eval/loss"], rel=1e-6))]


def test_sigint_saves_at_step_boundary_and_resume_matches(tmp_path, uninterrupted):
    _, whole = uninterrupted
    proc = start(tmp_path, *ARGS, hold_at=2)
    stopped_in(proc, tmp_path, 2, signal.SIGINT)
    code, _, err = finish_proc(proc)
    assert code == 0, err
    stopped = json.loads((tmp_path / "result-rank0.json").read_text())
    assert stopped["stopped"] and stopped["steps"] == 2
    assert ckpt.find_latest(tmp_path / "checkpoints").name == f"step-{stopped['steps']:07d}"
    resumed = finish(tmp_path, *ARGS, "--train.resume", "auto")
    assert adapters_equal(resumed["adapter_dir"], whole["adapter_dir"])


def test_random_sigkills_always_leave_a_valid_checkpoint(tmp_path, uninterrupted):
    """Kills at random moments, checkpoint writes included (save every step)."""
    _, whole = uninterrupted
    rng = random.Random(0)
    kills = int(os.environ.get("DTRAIN_KILLS", "6"))  # the closing note reports a run with 20
    for i in range(kills):
        out = tmp_path / f"run{i}"
        proc = start(out, *ARGS, "--train.save_every", "1", delay=0.05)
        wait_until(lambda: newest_step(out) >= 1, "a first checkpoint", proc)
        time.sleep(rng.uniform(0.0, 0.4))  # the kill's moment, not a wait: any moment must be safe
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert ckpt.find_latest(out / "checkpoints") is not None
        resumed = finish(out, *ARGS, "--train.resume", "auto")
        assert adapters_equal(resumed["adapter_dir"], whole["adapter_dir"]), f"kill {i}"


def test_corrupt_newest_checkpoint_is_reported_and_skipped(tmp_path):
    finish(tmp_path, "--train.steps", "6", "--train.save_every", "2", "--train.keep_last", "3")
    root = tmp_path / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-0000002", "step-0000004", "step-0000006"]
    weights = root / "step-0000006" / "adapters.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])
    (root / "step-0000004" / "manifest.json").unlink()  # as if killed before the manifest
    seen = []
    assert ckpt.find_latest(root, report=seen.append).name == "step-0000002"
    assert "checksum mismatch in adapters.safetensors" in seen[0] and "no manifest.json" in seen[1]


def test_a_damaged_checkpoint_of_the_run_is_pruned_as_a_valid_one_would_be(tmp_path):
    """keep_last counted only valid checkpoints: this run's damaged step-2 stayed beside the newest two for good,
    said nowhere (find_latest stops at the newest valid one). One whose run cannot be read is left alone."""
    from test_trainer import run

    args = ("train.save_every=2", "train.keep_last=2")
    run(tmp_path, "train.steps=4", *args)
    root = tmp_path / "checkpoints"
    weights = root / "step-0000002" / "adapters.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])
    shutil.copytree(root / "step-0000002", root / "step-0000001")
    (root / "step-0000001" / "state.json").write_text("{")  # whose run is unknown
    resumed, _ = run(tmp_path, "train.steps=8", *args, "train.resume=auto")
    assert len(resumed.history) == 4
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-0000001", "step-0000006", "step-0000008"]


def test_a_checkpoint_copied_under_another_steps_name_is_skipped_not_resumed(tmp_path):
    """`cp -r step-0000001 step-0000003` (or a symlink) made train.resume auto continue from step 1, the folder's
    state, and remove the run's newer step-0000002 at its first save; a folder whose state.json holds another step
    than its name is skipped as damaged, and the newest true checkpoint continues."""
    from test_trainer import run

    args = ("train.save_every=1", "train.keep_last=3")
    run(tmp_path, "train.steps=2", *args)
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step-0000001", root / "step-0000003")
    seen = []
    assert ckpt.find_latest(root, report=seen.append).name == "step-0000002"
    assert seen == [f"skipping checkpoint {root / 'step-0000003'}: state.json: step is 1, not the folder's 3"]
    with pytest.raises(UserError, match="is not a valid checkpoint: state.json: step is 1, not the folder's 3"):
        ckpt.load_checkpoint(root / "step-0000003")
    resumed, _ = run(tmp_path, "train.steps=3", *args, "train.resume=auto")
    assert len(resumed.history) == 1
    assert [ckpt.load_checkpoint(p).state.step for p in ckpt.list_checkpoints(root)] == [1, 2, 3]


def test_a_best_adapter_file_the_manifest_does_not_list_is_not_read(tmp_path):
    """A best.safetensors put into a checkpoint saved without one (copied from another checkpoint, or junk) was read
    on resume: junk refused the newest checkpoint with 'could not read checkpoint ...: [read] Unable to read 7 bytes
    from file', naming no file, and another run's best adapter was taken as this run's. Only files the manifest
    vouches for are part of a checkpoint."""
    from test_trainer import run

    args = ("train.save_every=1", "train.keep_last=2")
    run(tmp_path, "train.steps=2", *args)
    folder = tmp_path / "checkpoints" / "step-0000002"
    (folder / "best.safetensors").write_bytes(b"not one")
    assert ckpt.validate(folder) is None and ckpt.load_checkpoint(folder).best is None
    resumed, _ = run(tmp_path, "train.steps=3", *args, "train.resume=auto")
    assert len(resumed.history) == 1


def test_a_manifest_or_state_nested_too_deep_is_a_damaged_checkpoint(tmp_path):
    """A manifest.json or state.json of lists nested thousands deep ended the run in RecursionError's traceback
    (train.resume auto: while choosing the checkpoint, and while naming the run of the damaged one), where a
    damaged checkpoint is skipped, or refused when named."""
    folder = tmp_path / "checkpoints" / "step-0000002"
    folder.mkdir(parents=True)
    deep = "[" * 5000 + "]" * 5000
    (folder / "manifest.json").write_text(deep)
    (folder / "state.json").write_text(deep)
    assert ckpt.validate(folder) == "unreadable manifest (nested too deep for Python's recursion limit)"
    assert ckpt.find_latest(folder.parent, report=lambda _: None) is None
    assert ckpt._written_run_id(folder) is None
    with pytest.raises(UserError, match="is not a valid checkpoint: unreadable manifest"):
        ckpt.load_checkpoint(folder)


def test_only_step_folders_with_a_number_are_checkpoints_in_step_order(tmp_path):
    """Names were compared as text: a copy (`step-0000001 copy`, `step-1.bak`) sorted after step-0000002 and
    was resumed from, then pruned; step 10,000,000 sorted before step 9,999,999."""
    from test_trainer import run

    for name in ("step-12345678", "step-9999999", "step-0000010 copy", "step-x", "notes", "step-0000010"):
        (tmp_path / "names" / name).mkdir(parents=True)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "names")] == ["step-0000010", "step-9999999",
                                                                          "step-12345678"]
    out = tmp_path / "run"
    run(out, "train.steps=2", "train.save_every=1", "train.keep_last=5")
    root = out / "checkpoints"
    for copy in ("step-0000001 copy", "step-1.bak"):
        shutil.copytree(root / "step-0000001", root / copy)
    assert ckpt.find_latest(root).name == "step-0000002"
    resumed, _ = run(out, "train.steps=3", "train.save_every=1", "train.keep_last=1", "train.resume=auto")
    assert len(resumed.history) == 1  # step 3 only: continued from step 2
    assert sorted(p.name for p in root.iterdir()) == ["step-0000001 copy", "step-0000003", "step-1.bak"]


def test_pairs_sha256_covers_the_rejected_prompt_and_keeps_older_runs_hashes():
    """Two pairs that differ only in the rejected side's prompt hashed alike (a resume onto other data passed)."""
    import hashlib

    import numpy as np

    from dtrain.types import TokenizedPair
    shared = TokenizedPair([1, 2], [3], [4, 5])
    old = hashlib.sha256(b"".join(np.asarray(ids, np.int64).tobytes() + b"|" for ids in ([1, 2], [3], [4, 5])))
    assert ckpt.pairs_sha256([shared]) == old.hexdigest()  # shared-prompt pairs: the hash checkpoints hold
    two = [TokenizedPair([1, 2], [3], [4, 5], rejected_prompt=rp) for rp in ([1, 2, 9], [1, 2, 8], [])]
    hashes = {ckpt.pairs_sha256([p]) for p in two} | {ckpt.pairs_sha256([shared])}
    assert len(hashes) == 4


def test_every_bit_flip_of_a_manifest_is_skipped_or_harmless(tmp_path):
    """A manifest whose entry lost a key ("sha256" -> "sha257": one bit) raised KeyError out of validate, so
    `--train.resume auto` (and the launcher's restart) ended in a traceback instead of using step 2."""
    finish(tmp_path, "--train.steps", "4", "--train.save_every", "2", "--train.keep_last", "2")
    root = tmp_path / "checkpoints"
    manifest = root / "step-0000004" / "manifest.json"
    good = manifest.read_bytes()
    skipped = 0
    for i in range(len(good) * 8):
        bad = bytearray(good)
        bad[i // 8] ^= 1 << (i % 8)
        manifest.write_bytes(bytes(bad))
        seen = []
        found = ckpt.find_latest(root, report=seen.append)
        if found.name == "step-0000002":
            assert seen[0].startswith(f"skipping checkpoint {manifest.parent}: "), seen
            skipped += 1
        else:  # the step field or its key: the files are what the manifest lists
            assert not seen and json.loads(bytes(bad))["files"] == json.loads(good)["files"]
    assert skipped > len(good) * 7
    manifest.write_bytes(good.replace(b'"sha256"', b'"sha257"', 1))
    code, _, err = finish_proc(start(tmp_path, "--train.steps", "4", "--train.resume", "auto"))
    assert code == 0, err
    assert f"skipping checkpoint {manifest.parent}: unreadable manifest ('sha256')" in err
    assert f"resumed from {root / 'step-0000002'} at step 3" in err


def test_a_run_killed_while_writing_its_adapter_leaves_no_temporary_folder_after_the_resume(tmp_path):
    """SIGKILL inside the adapters/ write at the end (after the last checkpoint): the resume writes adapters/,
    and the killed write's hidden .adapters.tmp-PID folder stayed in the output folder for good."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    args = ("--train.steps", "4", "--train.save_every", "2", "--train.eval_every", "2")
    finish(whole, *args)
    cut.mkdir()
    proc = spawn([sys.executable, WORKER, cut, *args], tmp_path / "cut-logs", "worker",
                 env={**os.environ, "WORKER_HOLD_SAVE": "adapters.safetensors:3"})  # checkpoints 2, 4, then adapters/
    wait_for_path(cut / "in-save", proc)
    proc.kill()
    proc.wait()
    (cut / "in-save").unlink()
    assert [p.name for p in cut.glob(".adapters.tmp-*")] == [f".adapters.tmp-{proc.pid}"]
    finish(cut, *args, "--train.resume", "auto")
    assert adapters_equal(cut / "adapters", whole / "adapters")
    listing = lambda out: sorted(str(p.relative_to(out)) for p in out.rglob("*") if "tb" not in p.parts)  # noqa: E731
    assert listing(cut) == listing(whole)


def test_a_kill_between_an_adapter_folder_s_renames_leaves_no_old_copy_after_the_next_run(tmp_path):
    """files.atomic_folder moves the previous adapters/ aside to .adapters.old-PID before its rename and
    removes it after; SIGKILL in that removal left a hidden copy of the adapter that no later run removed
    (only the .tmp-PID folder was)."""
    from dtrain.files import clear_set_aside

    out = tmp_path / "out"
    for name in (".adapters.tmp-4242", ".adapters-last.tmp-4242", "data_cache/.tmp-abc.npz", ".write-test-4242"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        ((out / name).mkdir() if "adapters" in name else (out / name).write_bytes(b"x"))
    output.prepare_output(out, output.DiskPlan(0, 0, 0, 1), resuming=True).release()
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [".dtrain.lock", "data_cache"]
    for name in ("adapters", "adapters-last", ".adapters.old-4242", ".adapters-last.old-4242"):
        (out / name).mkdir()
        (out / name / "adapters.safetensors").write_bytes(name.encode())
    clear_set_aside(out, "adapters*")
    assert sorted(p.name for p in out.iterdir()) == [".dtrain.lock", "adapters", "adapters-last", "data_cache"]
    assert (out / "adapters" / "adapters.safetensors").read_bytes() == b"adapters"


def test_a_kill_between_the_two_renames_gets_the_folder_back(tmp_path):
    """SIGKILL after files.atomic_folder set the old folder aside and before the new one took its name left no
    adapters/ (or checkpoint step-N/) at all, and the next run removed the set-aside copy too: the old folder
    goes back to its name (and, an earlier run's adapter, is then not replaced by a new run)."""
    out = tmp_path / "out"
    for name in (".adapters.old-4242", ".adapters.tmp-4242", "checkpoints/.step-0000004.old-4242",
                 "checkpoints/.step-0000004.tmp-4242"):
        (out / name).mkdir(parents=True)
        (out / name / "adapters.safetensors").write_bytes(name.encode())
    ckpt.prune(out / "checkpoints", 3, "run")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000004"]
    assert (out / "checkpoints" / "step-0000004" / "adapters.safetensors").read_bytes() == (
        b"checkpoints/.step-0000004.old-4242")
    shutil.rmtree(out / "checkpoints")
    with pytest.raises(UserError, match="holds an earlier run's adapter"):
        output.prepare_output(out, output.DiskPlan(0, 0, 0, 1), resuming=False)
    assert sorted(p.name for p in out.iterdir()) == [".dtrain.lock", "adapters"]
    assert (out / "adapters" / "adapters.safetensors").read_bytes() == b".adapters.old-4242"


def test_a_checkpoint_set_aside_by_a_kill_is_resumed_from(tmp_path, capsys):
    """A run stopped in its last step saves before that step's evaluation; its resume saves step 4 again.
    SIGKILL between that save's two renames left step-0000004 set aside. The name came back only at the next
    run's first save, after resume auto had looked: it said "no checkpoint", trained from step 1 under a new
    run id, and with train.save_every 2 stopped at its end ("step-0000004 is a checkpoint of another run")."""
    from dtrain.run.trainer import Hooks
    from test_trainer import run

    def stop_in_4(step, run_):
        if step == 4:
            run_.stop.requested = True

    args = ("train.keep_last=1", "train.save_every=2")
    whole, _ = run(tmp_path / "whole", *args)
    run(tmp_path / "cut", *args, hooks=Hooks(before_step=stop_in_4))
    root = tmp_path / "cut" / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step-0000004"]
    (root / "step-0000004").rename(root / ".step-0000004.old-4242")
    shutil.copytree(root / ".step-0000004.old-4242", root / ".step-0000004.tmp-4242")  # the new one, not renamed
    capsys.readouterr()
    resumed, _ = run(tmp_path / "cut", *args, "train.resume=auto")
    assert "no checkpoint" not in capsys.readouterr().err
    assert resumed.history == [] and resumed.evals == whole.evals
    assert sorted(p.name for p in root.iterdir()) == ["step-0000004"]
    assert adapters_equal(tmp_path / "cut" / "adapters", tmp_path / "whole" / "adapters")


def test_an_output_folder_removed_mid_run_stops_at_the_next_save_saying_so(tmp_path):
    """`rm -rf` of the output folder while step 3 runs (a folder of that name made again at once): the save
    after step 4 failed on the TensorBoard file and said "the checkpoints are intact", of checkpoints that
    were gone; another run could also take the new folder while this one wrote into it."""
    out = tmp_path / "out"
    proc = start(out, "--train.steps", "6", "--train.save_every", "2", hold_at=3)
    wait_for_path(out / "in-step-3", proc)
    shutil.rmtree(out)
    out.mkdir()
    (out / "go-3").touch()
    code, _, err = finish_proc(proc)
    assert code == 2 and err.splitlines()[-1] == (
        f"dtrain: error: output folder {out} was removed or replaced while this run ran (its lock file is not the "
        f"one this run holds); step 4 is not saved there, and the checkpoints and TensorBoard events written "
        f"before went with the old folder"), err
    assert sorted(p.name for p in out.iterdir()) == ["go-3"]


def test_incompatible_resume_is_refused_in_one_line(tmp_path):
    """Every key is covered in-process by test_trainer; here the CLI-style worker: one line, exit 2."""
    finish(tmp_path, "--train.steps", "2")
    for override, changed in ((("--lora.rank", "4"), "lora.rank: 2 in the checkpoint, 4 now"),
                              (("--train.global_batch_pairs", "4"), "train.global_batch_pairs: 8 in the checkpoint, 4 now")):
        code, _, err = finish_proc(start(tmp_path, "--train.steps", "4", "--train.resume", "auto", *override))
        assert code == 2 and err.splitlines() == [
            f"dtrain: error: resume: {tmp_path}/checkpoints/step-0000002 was made with different settings: {changed}. "
            f"{ckpt.RESUME_HINT}"], err


def test_sigint_during_a_step_saves_right_after_that_step(tmp_path):
    """The stop flag is read at the step's all-reduce: a signal while step 3 runs stops after step 3, not 4."""
    proc = start(tmp_path, "--train.steps", "8", "--train.eval_every", "0", hold_at=3)
    stopped_in(proc, tmp_path, 3, signal.SIGINT)
    code, _, err = finish_proc(proc)
    assert code == 0, err
    stopped = json.loads((tmp_path / "result-rank0.json").read_text())
    assert stopped["stopped"] and stopped["steps"] == 3 and len(stopped["history"]) == 3
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-0000003"]
    assert "stopped by signal after step 3; checkpoint saved, continue with --train.resume auto" in err


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    """As under ./launch: the first SIGINT asks for a save after the step; the second ends the process at
    once, killed by SIGINT, inside the step (held there), with nothing saved."""
    proc = start(tmp_path, "--train.steps", "8", "--train.eval_every", "0", "--train.save_every", "0", hold_at=3)
    try:
        wait_for_path(tmp_path / "in-step-3", proc)
        proc.send_signal(signal.SIGINT)
        # the second, again until it comes stop.REPEAT_S after the first (a repeat within it is the same Ctrl-C)
        wait_until(lambda: proc.poll() is not None or proc.send_signal(signal.SIGINT), "the second SIGINT", proc)
        code, _, err = finish_proc(proc)
    finally:
        (tmp_path / "go-3").touch()
    assert code == -signal.SIGINT, err
    assert not (tmp_path / "checkpoints").exists() or not ckpt.list_checkpoints(tmp_path / "checkpoints")


def test_a_closed_terminal_saves_after_the_step_and_the_resume_matches(tmp_path, uninterrupted):
    """`dtrain train` at a terminal that closes (SIGHUP, then writes to it fail) saves after its step, as Ctrl-C does."""
    _, whole = uninterrupted
    master, terminal = pty.openpty()
    env = {**os.environ, "WORKER_HOLD_AT": "3"}
    proc = subprocess.Popen([sys.executable, WORKER, tmp_path, *ARGS], stdin=terminal, stdout=terminal, stderr=terminal,
                            env=env, start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(terminal)
    wait_for_path(tmp_path / "in-step-3", proc)
    os.close(master)  # the terminal goes away: its session gets SIGHUP
    (tmp_path / "go-3").touch()
    assert proc.wait() == 0
    stopped = json.loads((tmp_path / "result-rank0.json").read_text())
    assert stopped["stopped"] and stopped["steps"] == 3
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-0000003"]
    resumed = finish(tmp_path, *ARGS, "--train.resume", "auto")
    assert adapters_equal(resumed["adapter_dir"], whole["adapter_dir"])


def test_two_runs_started_together_into_one_folder(tmp_path, uninterrupted):
    """One takes the folder, the other stops at once with one line; the first run is unharmed."""
    import socket

    _, whole = uninterrupted
    procs = [start(tmp_path, *ARGS, delay=1.0) for _ in range(2)]
    done = [finish_proc(p) for p in procs]
    codes, errs = [c for c, _, _ in done], [e for _, _, e in done]
    assert sorted(codes) == [0, 2], errs
    winner, loser = codes.index(0), codes.index(2)
    assert errs[loser].splitlines() == [
        f"dtrain: error: output folder {tmp_path} is in use by another dtrain run (pid {procs[winner].pid} on "
        f"{socket.gethostname()}); wait for it to end, or choose another train.output_dir"]
    done = json.loads((tmp_path / "result-rank0.json").read_text())
    assert adapters_equal(done["adapter_dir"], whole["adapter_dir"])
    assert [p.name for p in (tmp_path / "tb").iterdir()] == [Path(done["run_dir"]).name]
    assert [s for s, _ in read_scalars(Path(done["run_dir"]))["loss"]] == list(range(1, 9))


def test_a_run_that_has_just_locked_the_folder_is_named(tmp_path):
    """Between a holder's lock and its name in the file the second run read nothing and said "another
    process" (once in CI); it now waits for the name, and a holder's longer earlier name is cut."""
    import threading

    path = tmp_path / ".dtrain.lock"
    path.write_text("pid 123456789 on an-earlier-host-with-a-long-name")  # a run that ended long ago
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)  # the old holder's way: an empty file until the name was written
        threading.Timer(0.3, lambda: os.pwrite(fd, b"pid 42 on here", 0)).start()
        with pytest.raises(UserError) as err:
            output.OutputLock(tmp_path)
        assert str(err.value) == (f"output folder {tmp_path} is in use by another dtrain run (pid 42 on here); "
                                  "wait for it to end, or choose another train.output_dir")
    finally:
        os.close(fd)
    lock = output.OutputLock(tmp_path)  # free again: taken, and the earlier longer name replaced whole
    try:
        import socket
        assert path.read_text() == f"pid {os.getpid()} on {socket.gethostname()}"
    finally:
        lock.release()


def test_a_reader_never_sees_two_names_mixed(tmp_path, monkeypatch):
    """Between writing its name and cutting the file, a holder's shorter name over a longer earlier
    one read as a mix of both ("pid 7 on here" + the old tail); it is padded, so a reader sees it whole."""
    import socket

    path = tmp_path / ".dtrain.lock"
    path.write_text("pid 123456789 on an-earlier-host-with-a-much-longer-name-than-this-one")
    seen, ftruncate = [], os.ftruncate

    def spy(fd, length):  # what a second run reads in the moment before the cut
        seen.append(os.pread(fd, 200, 0).decode().strip())
        ftruncate(fd, length)

    monkeypatch.setattr(output.os, "ftruncate", spy)
    lock = output.OutputLock(tmp_path)
    try:
        assert seen == [f"pid {os.getpid()} on {socket.gethostname()}"]
        assert path.read_text() == seen[0]
    finally:
        lock.release()


@pytest.mark.parametrize("kind", ["folder", "link", "dangling link"])
def test_a_lock_file_that_is_a_folder_or_a_link_is_named(tmp_path, kind):
    """A folder or a dangling link in .dtrain.lock's place was 'output folder X is not writable: Is a directory'
    (or 'No such file or directory'), though the folder was writable; a link to a file was followed and that file
    cut to the holder's name. Both are refused naming the lock file, and a link's target is left as it was."""
    out, lock = tmp_path / "out", tmp_path / "out" / ".dtrain.lock"
    out.mkdir()
    other = tmp_path / "notes.txt"
    other.write_text("someone's notes")
    {"folder": lock.mkdir, "link": lambda: lock.symlink_to(other),
     "dangling link": lambda: lock.symlink_to(tmp_path / "gone")}[kind]()
    with pytest.raises(UserError) as err:
        output.prepare_output(out, output.DiskPlan(0, 0, 0, 1), resuming=False)
    what = "a folder" if kind == "folder" else "a link"
    assert str(err.value) == (f"{lock.absolute()} is {what}, not dtrain's lock file; remove it, then start the run "
                              f"again")
    assert other.read_text() == "someone's notes"


@pytest.mark.parametrize("code", ["ENOLCK", "ENOTSUP"])
def test_a_folder_whose_file_system_cannot_lock_is_one_clear_line(tmp_path, monkeypatch, code):
    """Some network file systems (SMB, NFS without lockd) refuse flock: the run says so in one line,
    not "not writable", and keeps no descriptor of the lock file open."""
    import errno

    def refuse(fd, op):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    opened = []
    real_open = output.os.open
    monkeypatch.setattr(output.os, "open", lambda *a, **k: opened.append(real_open(*a, **k)) or opened[-1])
    monkeypatch.setattr(output.fcntl, "flock", refuse)
    with pytest.raises(UserError) as err:
        output.prepare_output(tmp_path / "out", output.DiskPlan(0, 0, 0, 1), resuming=False)
    assert str(err.value) == (f"output folder {tmp_path / 'out'} cannot be locked ({os.strerror(getattr(errno, code))}): "
                              "its file system does not support locks (a network share?); choose a train.output_dir "
                              "on a local disk")
    assert len(opened) == 1
    with pytest.raises(OSError):  # closed
        os.fstat(opened[0])


def test_a_full_disk_when_the_lock_names_its_holder_releases_the_folder(tmp_path, monkeypatch):
    """Writing the holder's name into .dtrain.lock failing (disk full) left the lock held by a descriptor
    nobody closed: the next run in this process, once there was room, was refused as "in use by another
    dtrain run"."""
    import errno

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as mp:
        mp.setattr(output.os, "pwrite", full)
        with pytest.raises(UserError) as err:
            output.prepare_output(tmp_path / "out", output.DiskPlan(0, 0, 0, 1), resuming=False)
    assert str(err.value) == f"output folder {tmp_path / 'out'} is not writable: {os.strerror(errno.ENOSPC)}"
    output.prepare_output(tmp_path / "out", output.DiskPlan(0, 0, 0, 1), resuming=False).release()


def test_a_checkpoint_of_another_run_is_never_replaced(tmp_path):
    import dataclasses

    import mlx.optimizers as optim

    from test_trainer import run

    _, model = run(tmp_path / "a", "train.steps=2")
    root = tmp_path / "a" / "checkpoints"
    mine = ckpt.load_checkpoint(root / "step-0000002").state
    before = {p.name: p.read_bytes() for p in (root / "step-0000002").iterdir()}
    optimizer = optim.AdamW(learning_rate=1e-3)
    optimizer.init(model.trainable_parameters())
    other = dataclasses.replace(mine, run_id="another-run")
    with pytest.raises(UserError) as err:
        ckpt.save_checkpoint(root, other, model, optimizer, None, {})
    assert str(err.value) == (f"{root}/step-0000002 is a checkpoint of another run (run id {mine.run_id}; "
                              f"this run is another-run); not replacing it")
    assert {p.name: p.read_bytes() for p in (root / "step-0000002").iterdir()} == before
    # the same run may re-save its own step (a resume that ends where it started)
    from dtrain.config import LoraConfig

    ckpt.save_checkpoint(root, mine, model, optimizer, LoraConfig(rank=2), {})
    assert ckpt.validate(root / "step-0000002") is None and [p.name for p in root.iterdir()] == ["step-0000002"]


def test_resume_into_a_folder_with_another_runs_checkpoints_is_refused(tmp_path):
    import shutil

    from test_trainer import run

    run(tmp_path / "a", "train.steps=1")
    run(tmp_path / "b", "train.steps=2", "train.save_every=1")
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-0000001", tmp_path / "b" / "checkpoints" / "step-0000001",
                    dirs_exist_ok=True)  # b's own step 1 becomes run a's
    with pytest.raises(UserError) as err:
        run(tmp_path / "b", "train.steps=3", "train.resume=auto")
    root = tmp_path / "b" / "checkpoints"
    assert str(err.value) == (f"{root} also holds checkpoints of another run (step-0000001); resuming "
                              f"{root}/step-0000002 there would mix two runs: train into a new train.output_dir")


def test_resume_path_must_be_a_valid_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # 'false' is read in the working folder, which may hold one
    with pytest.raises(UserError) as err:  # --train.resume false: a folder named false (the command line's text)
        ckpt.load_checkpoint(Path("false"))
    assert str(err.value) == ("resume: checkpoint folder false does not exist; train.resume takes null (a new run), "
                              "auto (the newest valid checkpoint in train.output_dir) or a checkpoint folder")
    (tmp_path / "step-0000001").mkdir()
    with pytest.raises(UserError, match="no manifest.json"):
        ckpt.load_checkpoint(tmp_path / "step-0000001")
    (tmp_path / "step-0000001" / "adapters.safetensors").write_bytes(b"")
    with pytest.raises(UserError) as err:  # it said the file "does not exist"
        ckpt.load_checkpoint(tmp_path / "step-0000001" / "adapters.safetensors")
    assert str(err.value) == (f"resume: {tmp_path}/step-0000001/adapters.safetensors is a file; name a checkpoint "
                              "folder (OUTPUT_DIR/checkpoints/step-N) or auto")


def test_resume_naming_an_output_folder_or_its_checkpoints_folder_names_the_checkpoint_to_give(tmp_path):
    """--train.resume runs/x (the run's folder, not one of its checkpoints) said only 'no manifest.json'."""
    out = tmp_path / "runs" / "x"
    for step in (2, 4):
        folder = out / "checkpoints" / f"step-{step:07d}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"step": step, "files": {}}))
        (folder / "state.json").write_text("{}")
    (out / "checkpoints" / "step-0000006").mkdir()  # a write that was interrupted: not named
    newest = out / "checkpoints" / "step-0000004"
    with pytest.raises(UserError) as err:
        ckpt.load_checkpoint(out)
    assert str(err.value) == (f"resume: {out} is a run's output folder, not a checkpoint; name one of its checkpoints "
                              f"(the newest valid one: {newest}), or train.resume auto with train.output_dir {out}")
    with pytest.raises(UserError) as err:
        ckpt.load_checkpoint(out / "checkpoints")
    assert str(err.value) == (f"resume: {out / 'checkpoints'} holds checkpoints, it is not one; name one of them (the "
                              f"newest valid one: {newest}), or train.resume auto with train.output_dir {out}")


def test_resume_naming_an_unreadable_folder_is_one_line(tmp_path, monkeypatch):
    """The hint that looks for checkpoints inside a folder named as one listed it, and a folder this user may not
    list ended in PermissionError's traceback (root lists any folder, so the listing is refused here by hand)."""
    folder = tmp_path / "locked"
    (folder / "checkpoints").mkdir(parents=True)
    real = Path.iterdir

    def iterdir(self):
        if self.is_relative_to(folder):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    with pytest.raises(UserError) as err:
        ckpt.load_checkpoint(folder)
    assert str(err.value) == (f"resume: {folder} is not a valid checkpoint: no manifest.json (not a checkpoint, or "
                              f"its write was interrupted)")


def test_output_folder_checks(tmp_path):
    with pytest.raises(UserError, match="MB free"):
        output.check_output_dir(tmp_path, need_bytes=10**18)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=f"^train.output_dir {blocker / 'out'} is under {blocker}, a file, not a folder"):
        output.check_output_dir(blocker / "out", need_bytes=1)


def test_a_failed_write_test_leaves_no_probe_file(tmp_path, monkeypatch):
    """A full disk fails the probe's write after its open created it: .write-test-PID stayed in the output folder."""
    def write_bytes(path, data):
        path.touch()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    with pytest.raises(UserError, match=f"^output folder {tmp_path} is not writable: No space left on device$"):
        output.check_output_dir(tmp_path, need_bytes=1)
    assert list(tmp_path.iterdir()) == []


def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path):
    code, _, err = finish_proc(start(tmp_path, "--train.steps", "10", "--train.learning_rate", "1e38",
                                     "--train.max_skipped_steps", "3", "--train.grad_clip", "0"))
    assert code == 2 and "non-finite" in err and "gen:" in err and "Traceback" not in err, err
    saved = ckpt.find_latest(tmp_path / "checkpoints")
    state = json.loads((saved / "state.json").read_text())
    assert state["skipped_steps"] == 3


def test_two_ranks_on_separate_disks_resume_from_rank_0s_checkpoint(tmp_path):
    """Two "machines" with their own folders: rank 1 is SIGKILLed at step 4 and
    rank 0 exits non-zero; only rank 0's disk holds checkpoints. `resume: auto`
    on both continues from rank 0's step 2 on both ranks (rank 0 sends the step,
    weights and optimizer state) and ends bitwise equal to an uninterrupted
    2-rank run; a 1-rank resume of the same checkpoint (same global batch) is accepted."""
    from test_distributed import WORKER as WORKER_DIST
    from test_distributed import finish as finish_ranks
    from test_distributed import run_cmd, start_ring

    args = ("train.save_every=2", "distributed.collective_timeout_s=20")
    whole = finish_ranks(start_ring(2, tmp_path / "whole", *args))
    assert [rc for rc, _, _ in whole] == [0, 0], whole
    disks = [tmp_path / "mac0", tmp_path / "mac1"]
    apart = (*args, "train.output_dir=run")  # relative: each rank's own disk, one config
    killed = finish_ranks(start_ring(2, tmp_path, *apart, "--kill-at", "4:1", disks=disks))
    assert killed[0][0] != 0 and killed[1][0] == -signal.SIGKILL
    root = disks[0] / "run" / "checkpoints"
    assert ckpt.find_latest(root).name == "step-0000002" and not (disks[1] / "run").exists()
    resumed = finish_ranks(start_ring(2, tmp_path, *apart, "train.resume=auto", disks=disks))
    assert [rc for rc, _, _ in resumed] == [0, 0], resumed
    a = mx.load(str(tmp_path / "whole" / "rank0.safetensors"))
    for r in (0, 1):
        b = mx.load(str(disks[r] / f"rank{r}.safetensors"))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a), r
    assert [len(json.loads((disks[r] / f"rank{r}.json").read_text())["history"]) for r in (0, 1)] == [3, 3]
    assert not (disks[1] / "run").exists()  # rank 1 never wrote a file there
    # the same checkpoint on one rank: world size may change when the global batch does not
    one = run_cmd([sys.executable, str(WORKER_DIST), str(disks[0]), *apart, "train.resume=run/checkpoints/step-0000004"],
                  cwd=disks[0])
    assert one.returncode == 0, one.stderr


def test_failed_checkpoint_write_stops_the_run_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    """The disk fills during the second checkpoint: the run stops with one
    message, the first checkpoint stays valid and no partial folder remains."""
    import errno

    from test_trainer import run

    real_save = mx.save_safetensors
    calls = {"n": 0}

    def failing_save(path, arrays, *a, **k):
        if "optimizer" in str(path):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(path, arrays, *a, **k)

    monkeypatch.setattr(mx, "save_safetensors", failing_save)
    with pytest.raises(UserError, match="could not write checkpoint .*step-0000004: No space left on device"):
        run(tmp_path, "train.steps=6", "train.save_every=2")
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step-0000002"]
    assert ckpt.validate(root / "step-0000002") is None


def test_atomic_folder_replaces_whole_or_not_at_all(tmp_path):
    from dtrain.files import atomic_folder

    final = tmp_path / "adapters"
    with atomic_folder(final) as tmp:
        (tmp / "a.txt").write_text("one")
    assert [p.name for p in tmp_path.iterdir()] == ["adapters"] and (final / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_folder(final) as tmp:
            (tmp / "a.txt").write_text("two")
            raise RuntimeError("disk on fire")
    assert [p.name for p in tmp_path.iterdir()] == ["adapters"] and (final / "a.txt").read_text() == "one"
    with atomic_folder(final) as tmp:
        (tmp / "b.txt").write_text("two")
    assert [p.name for p in tmp_path.iterdir()] == ["adapters"] and [p.name for p in final.iterdir()] == ["b.txt"]
    with pytest.raises(FileExistsError):
        with atomic_folder(final, replace=False):
            pass


def _edit_state(folder: Path, text: str = None, **fields) -> None:
    """Rewrite ``state.json`` as ``text``, or with ``fields`` changed (``...``: removed), and its manifest to match,
    as a hand edit or a tool that rewrote both would."""
    from dtrain.files import sha256_file

    if text is None:
        state = {**json.loads((folder / "state.json").read_text()), **fields}
        text = json.dumps({k: v for k, v in state.items() if v is not ...})
    (folder / "state.json").write_text(text)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["state.json"] = {"sha256": sha256_file(folder / "state.json"),
                                       "bytes": (folder / "state.json").stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name, change, why", [
    ("adapters.safetensors", "half", "adapters.safetensors has no model.layers.2.mlp.down_proj.lora_a (this run: "
                                     "float32 [64, 2])"),
    ("adapters.safetensors", "float16", "adapters.safetensors has model.layers.0.mlp.down_proj.lora_a as float16 "
                                        "[64, 2] (this run: float32 [64, 2])"),
    ("optimizer.safetensors", "half", "optimizer.safetensors has no model.layers.2.mlp.down_proj.lora_a.m (this "
                                      "run: float32 [64, 2])")])
def test_arrays_unlike_the_runs_with_a_rewritten_manifest_are_refused(tmp_path, name, change, why):
    """An adapters.safetensors or optimizer.safetensors swapped for another (a manifest rewritten to match) was put
    into the model as it was: half the LoRA weights missing kept their step-0 values and the run went on without a
    word, float16 weights trained in float16, and an optimizer state lacking entries ended in a traceback
    (KeyError, or a ValueError of shapes). Arrays whose names, shapes or dtypes differ from the run's are refused, naming the file."""
    from dtrain.files import sha256_file
    from test_trainer import run

    args = ("train.save_every=1", "train.keep_last=2")
    run(tmp_path, "train.steps=2", *args)
    folder = tmp_path / "checkpoints" / "step-0000002"
    arrays = mx.load(str(folder / name))
    keys = sorted(arrays)
    if change == "half":
        arrays = {k: arrays[k] for k in keys[: len(keys) // 2]}
    else:
        arrays = {k: v.astype(mx.float16) for k, v in arrays.items()}
    mx.save_safetensors(str(folder / name), arrays)
    manifest = json.loads((folder / "manifest.json").read_text())  # rewritten to match
    manifest["files"][name] = {"sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError) as err:
        run(tmp_path, "train.steps=3", *args, "train.resume=auto")
    assert str(err.value) == (f"resume: {folder} is not a valid checkpoint: {why}; continue from an earlier one "
                              f"(train.resume {folder.parent / 'step-N'})")


@pytest.mark.parametrize("key, value, why", [
    ("step", "2", "step is '2', not a whole number"), ("step", -1, "step is -1, below 0"),
    ("step", True, "step is True, not a whole number"), ("settings", [], "settings is [], not a mapping"),
    ("data", "fp", "data is 'fp', not a mapping"), ("schedule_steps", "4", "schedule_steps is '4', not a whole number"),
    ("best_step", "x", "best_step is 'x', not a whole number or null"), ("run_id", 7, "run_id is 7, not text"),
    ("closed", 1, "closed is 1, not true or false or null"), ("world_size", False, "world_size is False, not a whole number"),
    ("evals", {"two": {}}, "evals has the key 'two', not a step"), ("evals", {"2": 1.0}, "evals['2'] is 1.0, not a mapping"),
    # the adaptive λ controller's state (lambda_control.LambdaState): read at the resumed run's first step
    ("lambda_control", {"lam": "0.1"}, "lambda_control.lam is '0.1', not a number"),
    ("lambda_control", {"lam": 0.1, "lamb": 0.2}, "lambda_control has the key 'lamb', not one of the λ controller's"),
    ("lambda_control", {"phase": "hold"}, "lambda_control lacks lam")])
def test_a_state_json_of_wrongly_typed_fields_is_a_damaged_checkpoint(tmp_path, key, value, why):
    """A state.json whose manifest checksums match (a hand edit, or a tool that rewrote both) with `step` as text,
    `settings` as a list... ended the resume in a traceback (TypeError, AttributeError) where a damaged checkpoint
    is skipped by train.resume auto and refused, in one line naming state.json and the key, when named."""
    from test_trainer import run

    run(tmp_path, "train.steps=2", "train.save_every=1", "train.keep_last=2")
    root = tmp_path / "checkpoints"
    _edit_state(root / "step-0000002", **{key: value})
    seen = []
    assert ckpt.find_latest(root, report=seen.append).name == "step-0000001"
    assert seen == [f"skipping checkpoint {root / 'step-0000002'}: state.json: {why}"]
    with pytest.raises(UserError) as err:
        ckpt.load_checkpoint(root / "step-0000002")
    assert str(err.value) == f"resume: {root / 'step-0000002'} is not a valid checkpoint: state.json: {why}"
    if key == "step" and value == "2":  # the run itself continues from step 1
        resumed, _ = run(tmp_path, "train.steps=3", "train.save_every=1", "train.keep_last=2", "train.resume=auto")
        assert len(resumed.history) == 2


def test_a_state_json_that_is_not_an_object_or_lacks_a_field_is_one_line(tmp_path):
    """A state.json of a list or not JSON (checksums matching) ended in AttributeError or JSONDecodeError; one
    lacking a field is refused as one of an older dtrain, by name."""
    from test_trainer import run

    run(tmp_path, "train.steps=2", "train.save_every=1", "train.keep_last=2")
    root = tmp_path / "checkpoints"
    _edit_state(root / "step-0000002", step=...)
    with pytest.raises(UserError) as err:
        ckpt.load_checkpoint(root / "step-0000002")
    assert str(err.value) == (f"resume: {root / 'step-0000002' / 'state.json'} lacks step (written by an older "
                              f"dtrain?); it cannot be resumed by this version")
    folder = root / "step-0000001"
    _edit_state(folder, "[1]")
    assert ckpt.validate(folder) == "state.json: [1] is not a JSON object"
    assert ckpt.run_id_of(folder) is None
    _edit_state(folder, "{")
    assert ckpt.validate(folder).startswith("unreadable state.json (Expecting property name")


def test_a_finished_runs_checkpoint_of_an_older_dtrain_is_still_taken_as_finished(tmp_path):
    """state.json without `closed` (a dtrain before it): a resume at its step evaluates, saves and logs nothing."""
    from dtrain.run.tracking import read_events
    from test_trainer import run

    first, _ = run(tmp_path, "train.steps=2")
    last = tmp_path / "checkpoints" / "step-0000002"
    assert json.loads((last / "state.json").read_text())["closed"] is True
    _edit_state(last, closed=...)
    files = {p.name: p.read_bytes() for p in last.iterdir()}
    again, _ = run(tmp_path, "train.steps=2", "train.resume=auto")
    assert again.history == [] and {p.name: p.read_bytes() for p in last.iterdir()} == files
    assert [v.tag for e in read_events(again.run_dir) for v in e.summary.value].count("_hparams_/experiment") == 1
