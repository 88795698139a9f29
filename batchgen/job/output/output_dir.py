"""An output in a local directory (`OutputDir`), the output-store protocol (store.py) over rename, fsync and an
flock. A part appears whole or not at all: it is written under the temp directory, fsynced and renamed into place.

Anything not yet committed lives in the sibling directory `.<name>.batchgen-tmp/` (beside the output's real path),
removed after success: the lock, half-written files, and the final rewrite's staged parts and manifest (`final/`).
It holds a mark naming its output: a directory there without it is someone else's, and batchgen neither writes into
nor removes it. The lock is an flock on `lock` in it, which dies with its process (`lock_output`)."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..keys import JobConfigError, OutputBusy
from .parts import FINAL_PART, REPORT, REWRITE_MANIFEST, RUN_PART, SUCCESS, DamagedFileError, PartFile
from .store import Content, OutputStore

# Where older versions half-wrote _SUCCESS (its scratch now lives in the temp directory): batchgen's own, removed when
# a run takes the output.
LEFTOVER_SUCCESS_SCRATCH = SUCCESS + ".inprogress"
TMP_SUFFIX = ".batchgen-tmp"
SCRATCH_MARK = "batchgen-scratch.json"  # in the temp directory: {"output": the output's real path}


class OutputDir(OutputStore):
    """`output.path` on disk and its temp directory, and what a previous run left in them."""

    noun = "files"
    run_part = RUN_PART
    ignored = (LEFTOVER_SUCCESS_SCRATCH,)

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        # one temp directory (and lock) per real directory, whichever symlinked path names it
        self.real = Path(os.path.realpath(self.path))
        self.tmp = self.real.parent / f".{self.real.name}{TMP_SUFFIX}"
        self.staging = self.tmp / "final"
        self.lock_fd: int | None = None

    # -- the store's primitives -------------------------------------------------------------------------------

    def listing(self) -> dict[str, PartFile]:
        """Every entry, hidden ones included (nested_output looks into those)."""
        return {p.name: p for p in self.path.iterdir()} if self.path.is_dir() else {}

    def file(self, name: str, staged: bool = False) -> Path:
        return (self.staging if staged else self.path) / name

    def read(self, name: str, staged: bool = False) -> bytes | None:
        path = self.file(name, staged)
        return path.read_bytes() if path.is_file() else None

    def write(self, name: str, content: Content, row_group_size: int | None = None, create: bool = False,
              staged: bool = False) -> Path:
        """Whole or not at all: written in the temp directory and renamed into place. `create`: only if absent,
        which the run's flock makes a check before the rename (no other run writes the directory). A side file
        written while no run holds the output (`batchgen report` rewriting a finished one's) has its scratch hidden
        beside it."""
        target = self.file(name, staged)
        if create and os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "batchgen would overwrite a committed part", str(target))
        if isinstance(content, pa.Table):
            atomic_write(content, self, name, row_group_size=row_group_size, directory=target.parent)
        elif staged:
            atomic_write_text(target, _text(content))
        elif self.tmp.is_dir():
            atomic_write_text(target, _text(content), scratch_dir=self.tmp)
        else:
            atomic_write_text(target, _text(content), scratch_name=f".{name}.inprogress")
        return target

    def delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def lock(self) -> None:
        self.lock_fd = lock_output(self)

    def unlock(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def holder(self) -> str | None:
        pid = lock_holder(self)
        return None if pid is None else f"pid {pid}"

    def busy_message(self) -> str | None:
        pid = lock_holder(self)
        return None if pid is None else f"output.path: another batchgen run is writing {self.path} (pid {pid})"

    def check_location(self) -> None:
        """Refuse a path that is not a directory or cannot be written, an output nested in another job's output
        (or another's in it), and a temp directory someone else put there: batchgen would write into, or delete,
        what is not its own."""
        where = f"output.path: {self.path}"
        if self.path.exists() and not self.path.is_dir():
            raise JobConfigError(f"{where} exists and is not a directory")
        _check_writable(self.path)
        if self.real.name.endswith(TMP_SUFFIX):
            raise JobConfigError(f"{where}: names ending in {TMP_SUFFIX} are batchgen's temporary directories; "
                                 f"choose another output.path")
        if not self.tmp_is_ours():
            raise JobConfigError(f"{where}: {self.tmp}, where batchgen keeps this output's temporary files, is not "
                                 f"batchgen's (another job's output, or files batchgen did not put there); move it "
                                 f"away or choose another output.path")
        enclosing = self.enclosing_output()
        if enclosing is not None:
            raise JobConfigError(f"{where} is inside {enclosing}, another batchgen job's output (its readers would "
                                 f"read these rows too); choose an output.path outside it")
        nested = self.nested_output()
        if nested is not None:
            raise JobConfigError(f"{where} holds {nested}, another batchgen job's output (readers of this output "
                                 f"would read its rows too); choose another output.path")

    def run_part_name(self, seq: int) -> str:
        return f"run-{seq:05d}.parquet"

    def commit_time(self, part: PartFile) -> float:
        return Path(part).stat().st_mtime

    def begin_rewrite(self) -> None:
        if self.staging.exists():
            shutil.rmtree(self.staging)
        self.staging.mkdir(parents=True)

    def publish(self, names: list[str]) -> None:
        for name in names:
            if (self.staging / name).exists():
                os.replace(self.staging / name, self.path / name)
        _fsync(self.path)

    def end_rewrite(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def is_staged(self, part: PartFile) -> bool:
        return Path(part).parent == self.staging

    def discard_scratch(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)  # while locked, so that no other run holds this lock

    def reset_scratch(self) -> None:
        if self.staging.exists():
            shutil.rmtree(self.staging)
        self.prepare_tmp()

    # -- whose files are where --------------------------------------------------------------------------------

    def tmp_is_ours(self) -> bool:
        """The temp directory is this output's: absent, marked as this output's, or left by an older batchgen
        (unmarked, holding only what batchgen puts there)."""
        if not os.path.lexists(self.tmp):
            return True
        if self.tmp.is_symlink() or not self.tmp.is_dir():
            return False
        mark = self.tmp / SCRATCH_MARK
        if mark.is_file():
            try:
                return json.loads(mark.read_text()).get("output") == str(self.real)
            except (ValueError, OSError, AttributeError):
                return False
        return all(_is_scratch_entry(entry) for entry in self.tmp.iterdir())

    def make_tmp(self) -> None:
        """Create the temp directory (once tmp_is_ours said it may) and mark it as this output's."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        if not (self.tmp / SCRATCH_MARK).is_file():
            atomic_write_text(self.tmp / SCRATCH_MARK, json.dumps({"output": str(self.real)}))

    def prepare_tmp(self) -> None:
        """Create the temp directory; drop half-written files a killed run left there."""
        self.make_tmp()
        for stray in self.tmp.glob("*.inprogress"):
            stray.unlink()
        (self.path / LEFTOVER_SUCCESS_SCRATCH).unlink(missing_ok=True)

    def enclosing_output(self) -> Path | None:
        """A directory above this output that holds another job's output (or is batchgen's temp directory)."""
        for parent in self.real.parents:
            if parent.name.endswith(TMP_SUFFIX) or is_output_dir(parent):
                return parent
        return None

    def nested_output(self) -> Path | None:
        """Another job's output inside this one, in a hidden directory (a visible one is a foreign name)."""
        for name in self.names():
            top = self.path / name
            if not name.startswith(".") or top.is_symlink() or not top.is_dir():
                continue
            for folder, _, _ in os.walk(top):
                if is_output_dir(Path(folder)):
                    return Path(folder)
        return None


def _text(content: str | bytes) -> str:
    return content.decode() if isinstance(content, bytes) else content


def _is_scratch_entry(entry: Path) -> bool:
    """What batchgen puts in a temp directory: the lock, half-written files, the final parts being staged."""
    if entry.is_symlink():
        return False
    if entry.name == "lock" or entry.name.endswith(".inprogress"):
        return entry.is_file()
    if entry.name == "final" and entry.is_dir():
        return all(not p.is_symlink() and p.is_file() and (FINAL_PART.fullmatch(p.name) or p.name == REWRITE_MANIFEST
                                                           or p.name == REPORT or p.name.endswith(".inprogress"))
                   for p in entry.iterdir())
    return False


def is_output_dir(path: Path) -> bool:
    """Whether `path` holds a batchgen job's output, finished or not: its _SUCCESS, a part file carrying a
    fingerprint, or a temp directory marked as its own (a run that has committed nothing yet)."""
    out = OutputDir(path)
    try:
        if not path.is_dir():
            return False
        if "fingerprint" in (out.success() or {}):
            return True
        part = next((name for name in out.names() if out.is_part_name(name)), None)
        if part is not None and out.carries_fingerprint(part):
            return True
        mark = out.tmp / SCRATCH_MARK
        return mark.is_file() and json.loads(mark.read_text()).get("output") == str(out.real)
    except (OSError, ValueError, AttributeError, DamagedFileError):  # unreadable: not provably an output
        return False


def _check_writable(path: Path) -> None:
    """The directory, or the nearest folder above it that exists (where run creates it), can be written: the
    messages are those of run's own attempt (resume.output_errors), so that plan finds what run would."""
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    where = "" if existing == path.absolute() else f" ({existing})"
    if not existing.is_dir():
        raise JobConfigError(f"output.path: cannot write {path}: Not a directory{where}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JobConfigError(f"output.path: cannot write {path}: Permission denied{where}")


# -- the lock ---------------------------------------------------------------------------------------------------

def lock_output(out: OutputDir) -> int:
    """One run per output at a time (a cron overlap must not interleave parts). The lock dies with the process."""
    out.path.mkdir(parents=True, exist_ok=True)
    fd = _locked_file(out)
    try:
        with tempfile.TemporaryFile(dir=out.path, prefix=".batchgen-probe-"):
            pass  # a read-only output directory fails now, not at the first commit
        out.prepare_tmp()
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_holder(out: OutputDir) -> int | None:
    """The pid holding a running batchgen's lock on this output, from /proc/locks (Linux) without touching the
    lock: taking it, even for an instant, could make a run that starts then fail."""
    lock = out.tmp / "lock"  # lock_output's file
    try:
        stat = lock.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    for line in table.splitlines():
        fields = line.split()
        if "FLOCK" in fields and device in fields:
            return int(fields[fields.index(device) - 1])
    return None


def _locked_file(out: OutputDir) -> int:
    """The lock file, opened and locked. A run that finishes removes the temp directory with the lock in it: a
    lock taken on that removed file would lock nothing, so the file locked must still be the one at the path."""
    path = out.tmp / "lock"
    for _ in range(10):
        out.make_tmp()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except BlockingIOError:
            os.close(fd)
            holder = lock_holder(out)
            raise OutputBusy(f"output.path: another batchgen run is writing {out.path}"
                             f"{'' if holder is None else f' (pid {holder})'}; retry once it has finished") from None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed or replaced after we opened it: open the one there now
    raise JobConfigError(f"output.path: the lock file {path} keeps being replaced; is another batchgen run "
                         f"starting and finishing on {out.path}?")


# -- writing whole or not at all (tests stand in for these, by their module's names) ----------------------------

def atomic_write(table: pa.Table, out: OutputDir, name: str, row_group_size: int | None = None,
                 directory: Path | None = None) -> None:
    """Write under the temp directory, fsync, then rename to `directory/name` (default: the output path)."""
    target = (directory or out.path) / name
    scratch = out.tmp / f"{name}.inprogress"
    pq.write_table(table, scratch, row_group_size=row_group_size, write_page_checksum=True)
    _fsync(scratch)
    os.replace(scratch, target)
    _fsync(target.parent)


def atomic_write_text(path: Path, text: str, scratch_dir: Path | None = None, scratch_name: str | None = None) -> None:
    """Write `path` whole or not at all; the half-written scratch file lives in `scratch_dir` (default: beside it)."""
    scratch = (scratch_dir or path.parent) / (scratch_name or path.name + ".inprogress")
    scratch.write_text(text)
    _fsync(scratch)
    os.replace(scratch, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
