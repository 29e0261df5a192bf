"""Small file helpers shared by checkpoints, adapters, event files and the model cache.

:func:`atomic_folder` is the one way dtrain writes a folder that readers must
see whole or not at all (checkpoints, adapters): files go into a hidden
sibling, are fsynced, and the folder is renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
from dataclasses import dataclass
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterator, Optional

from .errors import UserError

# MLX reports I/O failures as RuntimeError: "[write] Unable to write 17309 bytes to file.",
# "[save_safetensors] Failed to open file X", "[load_safetensors] Failed to open file X".
_MLX_IO = re.compile(r"^\[\w+\] .*\b(file|write|read)", re.IGNORECASE)
# and a damaged safetensors file as RuntimeError from its reader or its JSON parser: "[safetensor] unsupported dtype
# Q9", "[load_safetensors] Tensor 'a' invalid data offsets (0, 8). Expecting 16 bytes.",
# "[json.exception.parse_error.101] parse error at line 1 ...", or as UnicodeDecodeError for a name not UTF-8
_MLX_DAMAGED = re.compile(r"^\[(safetensor|load_safetensors|json\.exception\.[\w.]+)\] ")
# Hugging Face tokenizers (Rust) reports a failed write of tokenizer.json as a bare Exception:
# "No space left on device (os error 28)" (Rust's io::Error text).
_RUST_IO = re.compile(r"\(os error \d+\)$")


class StorageError(UserError):
    """A file dtrain writes or reads failed (disk full, permissions, I/O); what was written before is intact."""



def to_devnull(*fds: int) -> None:
    """Point the file descriptors ``fds`` at /dev/null, so later writes to them (to a pipe
    whose reader ended, or to a hung-up terminal) are dropped without error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)

def storage_reason(err: BaseException) -> Optional[str]:
    """The one-line reason of a storage failure, or None when ``err`` is not one.

    ``OSError``: its ``strerror``; MLX's I/O ``RuntimeError`` (MLX raises no
    ``OSError``), MLX's errors for a damaged safetensors file and the tokenizers library's
    I/O ``Exception``: its message. Other errors (an MLX computation failing while arrays
    are evaluated for a save) are not storage failures.
    """
    if isinstance(err, OSError):
        return err.strerror or str(err)
    if isinstance(err, RuntimeError) and (_MLX_IO.match(str(err)) or _MLX_DAMAGED.match(str(err))):
        return str(err)
    if isinstance(err, UnicodeDecodeError):
        return str(err)
    if type(err) is Exception and _RUST_IO.search(str(err)):
        return str(err)
    return None


@contextlib.contextmanager
def storage(what: str, after: str = "") -> Iterator[None]:
    """Turn a storage failure inside the block into ``StorageError("could not {what}: {reason}{after}")``.

    Raises:
        StorageError: for what :func:`storage_reason` names; other exceptions pass unchanged.
    """
    try:
        yield
    except Exception as err:  # noqa: BLE001  (storage_reason picks the storage failures; the rest re-raised)
        reason = storage_reason(err)
        if reason is None:
            raise
        raise StorageError(f"could not {what}: {reason.rstrip('.')}{after}") from None


def cache_dir() -> Path:
    """dtrain's user cache (demo model, BLAS probe): ``$DTRAIN_CACHE`` if set, else ``~/.cache/dtrain``."""
    return Path(os.environ.get("DTRAIN_CACHE") or Path.home() / ".cache" / "dtrain")

# A Hugging Face hub id, owner/name (models and datasets alike); a local path of that shape wins.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def home_path(text: str | Path, key: str) -> Path:
    """``text`` with a leading ``~`` or ``~user`` read as that home folder (YAML expands nothing).

    Raises:
        UserError: ``~user`` of no user here, naming ``key``.
    """
    try:
        return Path(text).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory."
        raise UserError(f"{key} {text}: no home folder for {str(text).split('/')[0]}") from None


def home_text(text: str, key: str) -> str:
    """:func:`home_path` as text, for a path opening ``~``; any other ``text`` as given (``''`` stays empty)."""
    return str(home_path(text, key)) if text.startswith("~") else text


@dataclass(frozen=True)
class OutputDir:
    """The parts of a run's ``train.output_dir``, named in this one place (a leading ``~`` is the home folder)."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", home_path(self.root, "train.output_dir"))  # frozen: set once, here

    @property
    def checkpoints(self) -> Path:  # step-NNNNNNN folders (dtrain.run.checkpoint)
        return self.root / "checkpoints"

    @property
    def tb(self) -> Path:  # one TensorBoard run folder per run (dtrain.run.tracking)
        return self.root / "tb"

    @property
    def adapters(self) -> Path:  # the final adapter, as mlx-lm reads it (dtrain.lora)
        return self.root / "adapters"

    @property
    def adapters_last(self) -> Path:  # train.keep_best: the last step's adapter (dtrain.run.best)
        return self.root / "adapters-last"

    @property
    def data_cache(self) -> Path:  # tokenized pairs by content (dtrain.data.cache)
        return self.root / "data_cache"

    @property
    def lock(self) -> Path:  # held by the run that owns the folder (dtrain.run.output.OutputLock)
        return self.root / ".dtrain.lock"


def unusable_path(path: str, err: OSError, what: str = "path") -> str:
    """The one line for a path the file system cannot look up (a name longer than it allows): its first 80
    characters and ``err``'s reason; ``what``: what the path is for (``config file path`` ...)."""
    return f"{path[:80]}...: not a usable {what}: {err.strerror}"


def output_dir_problem(out: Path, err: OSError) -> str:
    """Why ``train.output_dir`` ``out`` could not be created or written (``err``), in words.

    ``mkdir`` says "File exists" for a file in its place and "Not a directory" for one
    above it; both are named as the file they are.
    """
    file = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if file is None:
        if err.errno == errno.EEXIST:  # no file: a link loop, whose own error names it
            try:
                os.stat(out)
            except OSError as loop:
                err = loop
        return f"output folder {out} is not writable: {err.strerror or err}"
    where = "is a file" if file == out else f"is under {file}, a file"
    return f"train.output_dir {out} {where}, not a folder; choose another train.output_dir"


_LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # how a Git LFS pointer file opens


def lfs_pointer_problem(path: Path) -> Optional[str]:
    """``'<path>: a Git LFS pointer, ...'`` when ``path`` holds a Git LFS pointer in place of its content (a
    repository cloned without git-lfs keeps these short texts for its large files), else None."""
    try:
        with open(path, "rb") as f:
            pointer = f.read(len(_LFS_POINTER)) == _LFS_POINTER
    except OSError:
        return None
    return (f"{path}: a Git LFS pointer, not the file's content (the repository was cloned without git-lfs); fetch it "
            "with git lfs pull, or download the file") if pointer else None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def new_temp_file(parent: Path, suffix: str) -> tuple[int, Path]:
    """``(fd, path)`` of a new file ``parent/.tmp-<pid>-<random><suffix>``, open for writing, whose mode follows
    the umask as the run's other outputs do (``tempfile.mkstemp``'s files are 0600 whatever the umask)."""
    tmp = parent / f".tmp-{os.getpid()}-{secrets.token_hex(4)}{suffix}"
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp


def fsync_path(path: Path) -> None:
    """Flush a file or a folder entry to disk (``os.fsync`` on a read-only fd)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def absent_folders(path: Path) -> list:
    """``path`` and the folders above it that do not exist yet, deepest first: what ``mkdir(parents=True)``
    makes of it, for :func:`remove_folders` to take back."""
    return [p for p in (path, *path.parents) if not p.exists()]


def remove_folders(folders) -> None:
    """Remove ``folders`` (deepest first, :func:`absent_folders`) while they are empty: the first that is not
    (something else was written there meanwhile) stops it, with those above it."""
    for p in folders:
        try:
            p.rmdir()
        except OSError:
            break


@contextlib.contextmanager
def atomic_folder(final: Path, replace: bool = True) -> Iterator[Path]:
    """Write a folder so that ``final`` is either the old folder or the complete new one.

    Yields a temporary sibling ``.<name>.tmp-<pid>`` to fill. When the block
    ends normally every file in it and the folder itself are fsynced, an
    existing ``final`` is moved aside, the temporary folder is renamed to
    ``final``, the parent is fsynced and the old folder removed. When the block
    raises, the temporary folder is removed and ``final`` is untouched; the folders made above it go again.
    (``rename(2)`` is atomic within one filesystem; POSIX.)

    Args:
        final: the folder to create or replace (a symlink: the folder it names).
        replace: when False, an existing ``final`` raises ``FileExistsError``
            before anything is written.
    Raises:
        FileExistsError: ``final`` exists and ``replace`` is False.
        OSError: from the filesystem (disk full, permissions).
    """
    final = Path(final)
    if final.is_symlink():  # a link (to a folder on another disk): renaming would replace it, not the folder it names
        try:  # a loop: its OSError (ELOOP), not Path.resolve's RuntimeError (Python < 3.13)
            final = Path(os.path.realpath(final, strict=True))
        except FileNotFoundError:  # a dangling link: the folder it names is made
            final = Path(os.path.realpath(final))
    if final.exists() and not replace:
        raise FileExistsError(f"{final} already exists")
    # through a link too (checkpoints/ naming a folder on another disk not made yet): a link's mkdir is EEXIST
    parent = Path(os.path.realpath(final.parent))
    made = absent_folders(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        os.stat(final.parent)  # a link loop: its ELOOP, not mkdir's "File exists"
        raise
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crash of a process with this pid
    tmp.mkdir()
    try:
        yield tmp
        for p in tmp.iterdir():
            fsync_path(p)
        fsync_path(tmp)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            old.rename(final)  # the rename of the new folder failed: put the old one back
        remove_folders(made)
        raise
    shutil.rmtree(old, ignore_errors=True)


def clear_set_aside(parent: Path, pattern: str) -> None:
    """Tidy what :func:`atomic_folder` left in ``parent`` when its process was killed (``pattern``: a glob
    of final names, ``adapters*``): an old folder ``.NAME.old-PID`` goes back to ``NAME`` when ``NAME`` is
    missing (killed between the two renames), else it goes; a new one ``.NAME.tmp-PID`` goes."""
    for old in sorted(parent.glob(f".{pattern}.old-*")):
        final = parent / old.name[1:].rsplit(".old-", 1)[0]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.rename(final)
    for tmp in parent.glob(f".{pattern}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
