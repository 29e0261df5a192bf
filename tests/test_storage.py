"""Storage failures are one line and leave the earlier checkpoint intact; the
free-space check counts what the run will write (issue 22 §5).

The write sites are not listed by hand: a first run records every call that
writes (``mx.save_safetensors``, ``Path.write_text/write_bytes/mkdir/rename``,
TensorBoard's record writer, ``os.fsync``) with the file it touches, and a
failure is then injected at the last call of each site, both as MLX raises it
(``RuntimeError: [write] Unable to write 17309 bytes to file.``) and as
``OSError(ENOSPC)``.
"""

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from tensorboardX.record_writer import RecordWriter

from dtrain.run import checkpoint as ckpt, output
from dtrain.errors import UserError
from dtrain.files import StorageError, storage, storage_reason
from dtrain.run.tracking import RunLogger, read_scalars
from test_trainer import run

MLX_WRITE = "[write] Unable to write 17309 bytes to file."
ARGS = ("train.steps=4", "train.save_every=2", "train.eval_every=2")


def _norm(name: str) -> str:
    for pattern, repl in ((r"^\.?step-\d+.*", "step"), (r"^\.adapters\..*", "adapters"),
                          (r"^\d{8}-\d{6}-\d+$", "tb-run"), (r"^events\.out\.tfevents\..*", "events"),
                          (r"^\.write-test-\d+$", ".write-test")):
        name = re.sub(pattern, repl, name)
    return name


def site_of(path, out: Path) -> str:
    """A write site: the file's name in its kind of folder (step numbers, times and temporary suffixes dropped)."""
    p = Path(path)
    if p == out:
        return "OUT"
    return f"{'OUT' if p.parent == out else _norm(p.parent.name)}/{_norm(p.name)}"


class Spy:
    """Wraps the write functions; records ``(function, site)`` per call, or raises at one chosen call."""

    TARGETS = [(mx, "save_safetensors"), (Path, "write_text"), (Path, "write_bytes"), (Path, "mkdir"),
               (Path, "rename"), (RecordWriter, "write"), (RecordWriter, "flush"), (os, "fsync")]

    def __init__(self, monkeypatch, out: Path, fail=None, error=None):
        self.calls, self.out, self.fail, self.error = [], out, fail, error
        for owner, name in self.TARGETS:
            monkeypatch.setattr(owner, name, self.wrap(name, getattr(owner, name)))

    def wrap(self, name, real):
        spy = self

        def call(*args, **kw):
            first = args[0] if args else None
            target = getattr(first, "path", None) if isinstance(first, RecordWriter) else first
            if name == "fsync":
                target = "fd"
            elif not str(target).startswith(str(spy.out)):
                return real(*args, **kw)
            site = (name, "fd" if name == "fsync" else site_of(target, spy.out))
            spy.calls.append(site)
            if spy.fail is not None and (site, spy.calls.count(site)) == spy.fail:
                raise spy.error
            return real(*args, **kw)

        return call


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    out = tmp_path_factory.mktemp("spy")
    mp = pytest.MonkeyPatch()
    try:
        spy = Spy(mp, out)
        run(out, *ARGS)
    finally:
        mp.undo()
    counts = {s: spy.calls.count(s) for s in dict.fromkeys(spy.calls)}
    return counts


def test_the_recorded_write_sites_cover_checkpoint_adapter_and_tensorboard(sites):
    names = {site for _, site in sites}
    assert {"step/adapters.safetensors", "step/optimizer.safetensors", "step/state.json", "step/config.yaml",
            "step/manifest.json", "step/adapter_config.json", "adapters/adapters.safetensors",
            "adapters/adapter_config.json", "tb-run/events"} <= names, names


ERRORS = {"mlx": lambda: RuntimeError(MLX_WRITE), "enospc": lambda: OSError(errno.ENOSPC, "No space left on device")}


@pytest.mark.parametrize("kind", ERRORS)
def test_a_write_failure_at_each_site_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch, sites, kind):
    """OSError at every site; MLX's RuntimeError where MLX writes (Python's own writes raise OSError only)."""
    reason = {"mlx": MLX_WRITE.rstrip("."), "enospc": "No space left on device"}[kind]
    chosen = {s: c for s, c in sites.items() if kind == "enospc" or s[0] == "save_safetensors"}
    assert len(chosen) >= (2 if kind == "mlx" else 15)
    for n, (site, count) in enumerate(sorted(chosen.items())):
        out = tmp_path / f"site{n}"
        with monkeypatch.context() as mp:
            Spy(mp, out, fail=(site, count), error=ERRORS[kind]())
            with pytest.raises(UserError) as err:
                run(out, *ARGS)
        message = str(err.value)
        assert "\n" not in message and message.startswith(("could not ", "output folder ")), (site, message)
        assert reason in message, (site, message)
        root = out / "checkpoints"
        valid = [p.name for p in ckpt.list_checkpoints(root) if ckpt.validate(p) is None]
        if "step-0000004" in message or "adapters" in message:
            assert valid[:1] == ["step-0000002"] and "intact" in message or "holds the same weights" in message, \
                (site, message, valid)
        leftovers = [p.name for d in (out, root) if d.is_dir() for p in d.iterdir() if ".tmp-" in p.name]
        assert leftovers == [], (site, leftovers)


def test_a_failed_second_checkpoint_leaves_the_first_and_names_both(tmp_path, monkeypatch):
    """The issue's example: MLX's RuntimeError while writing step 4's optimizer state."""
    with monkeypatch.context() as mp:
        Spy(mp, tmp_path, fail=(("save_safetensors", "step/optimizer.safetensors"), 2), error=RuntimeError(MLX_WRITE))
        with pytest.raises(UserError) as err:
            run(tmp_path, *ARGS)
    assert str(err.value) == (f"could not write checkpoint {tmp_path}/checkpoints/step-0000004: [write] Unable to "
                              f"write 17309 bytes to file; the previous checkpoints are intact")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-0000002"]
    assert ckpt.validate(tmp_path / "checkpoints" / "step-0000002") is None
    resumed, _ = run(tmp_path, *ARGS, "train.resume=auto")
    assert len(resumed.history) == 2


def test_a_failed_adapters_last_write_is_one_line_naming_it(tmp_path, monkeypatch):
    """train.keep_best writes the last step's adapter to adapters-last/ first; a failure there was a traceback."""
    real = mx.save_safetensors

    def save(path, *a, **k):
        if "adapters-last" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, *a, **k)

    monkeypatch.setattr(mx, "save_safetensors", save)
    with pytest.raises(StorageError) as err:
        run(tmp_path, "train.steps=2", "train.eval_every=1", "train.keep_best=eval/loss")
    assert str(err.value) == (f"could not write the adapter {tmp_path}/adapters-last: Permission denied; checkpoint "
                              f"{tmp_path}/checkpoints/step-0000002 holds the same weights")
    assert ckpt.validate(tmp_path / "checkpoints" / "step-0000002") is None
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


def test_storage_passes_other_errors_through():
    assert storage_reason(RuntimeError("[metal::malloc] Attempting to allocate 1 bytes")) is None
    assert storage_reason(RuntimeError("[load_safetensors] Failed to open file x")) == \
        "[load_safetensors] Failed to open file x"
    with pytest.raises(RuntimeError, match="malloc"), storage("write x"):
        raise RuntimeError("[metal::malloc] Attempting to allocate 1 bytes")
    with pytest.raises(StorageError, match=r"^could not read y: Permission denied$"), storage("read y"):
        raise PermissionError(errno.EACCES, "Permission denied")


def test_the_tokenizers_librarys_io_error_is_a_storage_failure():
    """Hugging Face tokenizers (Rust) raises a bare Exception for a failed write of tokenizer.json, as
    'No space left on device (os error 28)': `dtrain export` and `convert` on a full disk ended in its traceback."""
    full = "No space left on device (os error 28)"
    assert storage_reason(Exception(full)) == full
    with pytest.raises(StorageError, match=r"^could not write x: No space left on device \(os error 28\)$"), \
            storage("write x"):
        raise Exception(full)
    with pytest.raises(Exception, match="^boom$"), storage("write x"):  # any other Exception passes unchanged
        raise Exception("boom")


def test_an_unreadable_checkpoint_is_one_line(tmp_path, monkeypatch):
    run(tmp_path, "train.steps=2")
    real = mx.load

    def failing(path, *a, **k):
        if "optimizer" in str(path):
            raise RuntimeError(f"[load_safetensors] Failed to open file {path}")
        return real(path, *a, **k)

    monkeypatch.setattr(mx, "load", failing)
    with pytest.raises(UserError) as err:
        run(tmp_path, "train.steps=4", "train.resume=auto")
    step = tmp_path / "checkpoints" / "step-0000002"
    assert str(err.value) == (f"could not read checkpoint {step}: [load_safetensors] Failed to open file "
                              f"{step}/optimizer.safetensors")


def test_cli_exit_status_2_and_one_line_on_a_full_disk(tmp_path):
    """The training worker (as the dtrain command) with MLX's write error at step 4's checkpoint."""
    worker = Path(__file__).resolve().parent / "train_worker.py"
    env = {**os.environ, "WORKER_FAIL_SAVE": "optimizer.safetensors:2"}
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), "--train.steps", "4", "--train.save_every",
                           "2"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
        f"dtrain: error: could not write checkpoint {tmp_path}/checkpoints/step-0000004: [write] Unable to write "
        f"17309 bytes to file; the previous checkpoints are intact"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert ckpt.validate(tmp_path / "checkpoints" / "step-0000002") is None


# -- the free-space check ---------------------------------------------------------------------


def plan(keep_last=2, steps=8, save_every=2):
    return output.DiskPlan(4_000_000, steps, save_every, keep_last)


@pytest.mark.parametrize("kept, done, more", [
    (0, 0, 3),  # a fresh run: keep_last + 1 checkpoints at the peak
    (2, 4, 1),  # a resume with keep_last on disk: one more, then the oldest is pruned
    (1, 6, 1),  # one kept, one save ahead
    (2, 8, 0),  # resume of the final step: nothing more but the adapter
    (4, 4, 1),  # more on disk than keep_last (it was lowered): the first save still writes one before pruning
])
def test_disk_plan_counts_the_checkpoints_already_on_disk(kept, done, more):
    assert plan().need(kept, done) == (more * 4_000_000 + 1_000_000, more)


def test_disk_plan_of_a_huge_train_steps_is_counted_not_listed(tmp_path, monkeypatch):
    """train.steps=10**12 (a run meant to end by train.early_stop_evals) hung before its first line: the trainer
    listed every step that saves a checkpoint to plan the free space."""
    plans = []

    def planned(out, p, resuming):
        plans.append(p)
        raise UserError("planned")

    monkeypatch.setattr(output, "prepare_output", planned)
    with pytest.raises(UserError, match="planned"):
        run(tmp_path, f"train.steps={10**12}", "train.save_every=1", "train.warmup_steps=0")
    assert plans[0].need(0, 0) == (3 * plans[0].checkpoint_bytes + plans[0].checkpoint_bytes // 4, 3)
    assert plans[0].need(2, 10**12 - 1) == (plans[0].checkpoint_bytes * 5 // 4, 1)  # the last step's save ahead


def test_disk_plan_of_keep_best_counts_both_adapter_folders(tmp_path, monkeypatch):
    """A checkpoint is 4 adapters' worth (its adapter, AdamW's two moments, the best step's copy); a
    train.keep_best run ends by writing two adapter folders (adapters/ and adapters-last/), each an
    adapter's worth, and the trainer plans for both."""
    assert output.DiskPlan(4_000_000, 8, 2, 2, adapters=2).need(2, 8) == (2_000_000, 0)
    assert output.DiskPlan(4_000_000, 8, 2, 2, adapters=2).need(0, 0) == (3 * 4_000_000 + 2_000_000, 3)
    plans = []
    real = output.prepare_output
    monkeypatch.setattr(output, "prepare_output", lambda out, p, resuming: plans.append(p) or real(out, p, resuming))
    run(tmp_path / "best", "train.steps=2", "train.eval_every=1", "train.keep_best=eval/loss")
    run(tmp_path / "last", "train.steps=2")
    assert [p.adapters for p in plans] == [2, 1]


def test_leftovers_that_cannot_be_removed_are_one_line_and_release_the_folder(tmp_path):
    """What a killed run left (data_cache/.tmp-*) is removed before the folder's checks; in a folder that is
    not writable the removal was a PermissionError traceback."""
    (tmp_path / "data_cache").mkdir()
    (tmp_path / "data_cache" / ".tmp-123").write_text("")

    def refused(self, missing_ok=False):
        raise PermissionError(errno.EACCES, "Permission denied")

    assert prepare_refused(tmp_path, "unlink", refused) == (f"could not remove what a killed run left in {tmp_path}: "
                                                            "Permission denied")
    assert not (tmp_path / "data_cache" / ".tmp-123").exists()


@pytest.mark.parametrize("resuming", [True, False])
def test_a_checkpoints_folder_that_cannot_be_listed_is_one_line_and_releases_the_folder(tmp_path, resuming):
    """A checkpoints/ this user may not list (made by another user, chmod 000) was a PermissionError traceback
    from the check for earlier checkpoints, fresh run or resume."""
    run(tmp_path, "train.steps=2")
    real = Path.iterdir

    def refused(self):
        if self.name == "checkpoints":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    assert prepare_refused(tmp_path, "iterdir", refused, resuming) == (
        f"could not read the checkpoints in {tmp_path / 'checkpoints'}: Permission denied")


def prepare_refused(out: Path, method: str, refused, resuming: bool = False) -> str:
    """``prepare_output``'s StorageError text while ``Path.<method>`` is ``refused``; the folder's lock is then
    free (a second prepare takes it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, method, refused)
        with pytest.raises(StorageError) as err:
            output.prepare_output(out, plan(), resuming=resuming)
    output.prepare_output(out, plan(), resuming=True).release()
    return str(err.value)


def test_resume_free_space_check_counts_the_checkpoint_it_will_prune(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    run(tmp_path, "train.steps=4", "train.save_every=2")  # keep_last 2: step-2 and step-4 on disk
    p = output.DiskPlan(4_000_000, 6, 2, 2)  # saves at steps 2, 4 and 6
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 0, 5_000_000))
    output.prepare_output(tmp_path, p, resuming=True).release()  # 4 MB checkpoint + 1 MB adapter fit in 5 MB
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 0, 4_999_999))
    with pytest.raises(UserError) as err:
        output.prepare_output(tmp_path, p, resuming=True)
    assert str(err.value) == (f"output folder {tmp_path} has 5.0 MB free; this run needs about 5.0 MB there: 1 new "
                              f"checkpoint(s) of 4.0 MB before the oldest beyond train.keep_last=2 is pruned (2 on "
                              f"disk now), and the adapter")


def test_an_event_file_cut_short_by_a_full_disk_reads_up_to_its_last_whole_record(tmp_path):
    """A short write (ENOSPC) leaves the last record cut; TensorBoard skips it, and so does read_scalars."""
    log = RunLogger(tmp_path, 3, progress=False)
    for step in (1, 2, 3):
        log.scalars(step, {"loss": float(step)})
    log.close()
    (events,) = tmp_path.glob("events.out.tfevents.*")
    events.write_bytes(events.read_bytes()[:-10])  # record 3: its crc and 6 bytes of its payload missing
    assert read_scalars(tmp_path) == {"loss": [(1, 1.0), (2, 2.0)]}


def test_the_free_space_check_counts_the_tokenized_pairs_the_run_caches(tmp_path, monkeypatch):
    """The check counted checkpoints and adapters, not the tokenized pairs the run then writes into data_cache/
    (int32 ids of every pair: on a large data set far more than a LoRA checkpoint), which could take the room the
    check found for the first checkpoint. Now they count, as about what the entries take on disk."""
    import shutil
    from collections import namedtuple
    from types import SimpleNamespace

    from conftest import make_tiny_model, make_tokenizer
    from dtrain.config import load_config
    from dtrain.run.trainer import train

    plans = []
    real = output.prepare_output
    monkeypatch.setattr(output, "prepare_output", lambda out, p, resuming: plans.append(p) or real(out, p, resuming))
    cfg = load_config(None, [f"train.output_dir={tmp_path / 'run'}", "data.demo_pairs=64", "train.steps=1",
                             "train.global_batch_pairs=4", "train.micro_batch_pairs=4", "lora.rank=2",
                             "train.progress=false", "train.eval_every=0"])
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=make_tokenizer(), identity="tiny",
                             source="tiny-llama", reference={"path": "tiny-llama"})
    train(cfg, loaded=loaded)
    written = sum(p.stat().st_size for p in (tmp_path / "run" / "data_cache").glob("*.npz"))
    assert written > 0 and written <= plans[0].cache_bytes <= 2 * written

    p = output.DiskPlan(4_000_000, 6, 2, 2, cache_bytes=3_000_000)
    assert p.need(0, 0) == (3 * 4_000_000 + 1_000_000 + 3_000_000, 3)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 0, 15_999_999))
    with pytest.raises(UserError) as err:
        real(tmp_path / "new", p, resuming=False)
    assert str(err.value) == (f"output folder {tmp_path / 'new'} has 16.0 MB free; this run needs about 16.0 MB there: "
                              f"3 new checkpoint(s) of 4.0 MB before the oldest beyond train.keep_last=2 is pruned "
                              f"(0 on disk now), and the adapter; and 3.0 MB of tokenized pairs for "
                              f"{tmp_path / 'new' / 'data_cache'}")


@pytest.mark.parametrize("what, line", [
    ("checkpoint", "could not write checkpoint {run}/checkpoints/step-0000004: No space left on device; the previous "
                   "checkpoints are intact"),
    ("events", "could not write TensorBoard events {events}: No space left on device; the checkpoints are intact"),
])
def test_a_full_disk_on_rank_0_mid_run_is_its_one_line_and_the_other_ranks_stop_quietly(tmp_path, what, line):
    """Rank 0's disk fills after step 3 (its step-4 checkpoint or step 3's TensorBoard events cannot be written).
    Rank 0 raised at once, and rank 1, waiting in the next step's all-reduce, failed with '[ring] connection to a
    peer was lost' (exit status 4 under ./launch: a lost peer, which --max-restarts restarts, and which the launcher
    blamed when its report came first). Now rank 0's failure is agreed in the next collective: rank 1 stops with it,
    without a word, and rank 0 gives its one line."""
    from test_distributed import finish as finish_ranks, start_ring

    results = finish_ranks(start_ring(2, tmp_path, "--full-disk", f"3:{what}", "train.save_every=2"))
    (rc0, err0, _), (rc1, err1, _) = results
    run_dir = tmp_path / "run"
    (events,) = (run_dir / "tb").glob("*/events.out.tfevents.*")
    assert (rc0, err0.splitlines()[-1:]) == (2, ["dtrain: error: " + line.format(run=run_dir, events=events)]), err0
    assert "Traceback" not in err0 and (rc1, err1) == (0, ""), (rc1, err1[-2000:])
    assert [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")] == ["step-0000002"]
    assert ckpt.validate(run_dir / "checkpoints" / "step-0000002") is None
