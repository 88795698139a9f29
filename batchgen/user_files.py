"""Reading a file from a path the user gave (the job file, a schema file, a model directory's config and tokenizer):
it must be a regular file, and no larger than what such a file can reasonably be, checked before a byte is read.
A FIFO, a device (/dev/zero), a directory or a huge file is refused with a message naming the path, instead of
blocking forever or filling memory.

The file is opened non-blocking (opening a FIFO does not wait for a writer), then checked on the open descriptor,
so what is read is what was checked."""
from __future__ import annotations

import os
import stat
from pathlib import Path

MiB = 2**20

# Caps by kind of file. A job file or a JSON schema of more than a few MiB is a mistake; a tokenizer.json of a
# large-vocabulary model is ~33 MB (Gemma 3), so tokenizer files get more room.
JOB_FILE_LIMIT = 16 * MiB
SCHEMA_FILE_LIMIT = 16 * MiB
MODEL_CONFIG_LIMIT = 16 * MiB
TOKENIZER_FILE_LIMIT = 512 * MiB


class UserFileError(ValueError):
    """A user-given file that cannot or must not be read. The message names the path; callers prefix the key."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n / MiB:,.1f} MiB" if n >= MiB else f"{n:,} bytes"


def check_regular_file(path: str | Path, limit: int | None = None) -> int:
    """Raise UserFileError unless `path` is a regular file (symlinks followed) of at most `limit` bytes; its size."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UserFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    return _check_stat(path, st, limit)


def _check_stat(path: str | Path, st: os.stat_result, limit: int | None) -> int:
    if not stat.S_ISREG(st.st_mode):
        raise UserFileError(f"{path} is {_kind(st.st_mode)}, not a regular file")
    if limit is not None and st.st_size > limit:
        raise UserFileError(f"{path} is {_size(st.st_size)}, more than the {_size(limit)} such a file may be")
    return st.st_size


def read_user_bytes(path: str | Path, limit: int) -> bytes:
    """The whole file, once it is known to be a regular file of at most `limit` bytes."""
    check_regular_file(path, limit)  # a socket cannot even be opened: say what it is
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UserFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        _check_stat(path, os.fstat(fd), limit)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(limit + 1)
        except OSError as exc:
            raise UserFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > limit:  # grew since the check
        raise UserFileError(f"{path} is more than the {_size(limit)} such a file may be")
    return data


def read_user_text(path: str | Path, limit: int) -> str:
    """The file as UTF-8 text (read_user_bytes' checks first)."""
    data = read_user_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserFileError(f"{path}: not UTF-8 text (byte {exc.start}: "
                            f"{data[exc.start:exc.start + 1]!r})") from None
