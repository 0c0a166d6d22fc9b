"""Private: output paths of the commands: checked before anything runs, and written when the run ends
(``check --json``, ``bench --json``, ``bench --trace``, ``bench --plot``, ``check --markdown``).

Standard library only, so that a bad path is refused before torch's heavier modules are imported.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import TextIO

__all__ = ["output_dir_problem", "output_file_problem", "write_output"]


def _standard_stream(path: str) -> TextIO | None:
    """``sys.stdout`` or ``sys.stderr`` where ``path`` is that stream's file: ``/dev/stdout``, or the file or
    pipe the shell redirected it to, under any name (written through the stream, in order with the rest of
    the output, never reopened: a reopened redirected file would be truncated or renamed over)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        with contextlib.suppress(OSError, ValueError):
            if os.path.samestat(st, os.fstat(fd)):
                return stream
    return None


def output_file_problem(path: str) -> str | None:
    """Why ``path`` cannot be written as an output file (``None`` when it can); nothing it creates stays.

    Shared by ``check --json``/``--markdown`` and ``bench --json``; a missing folder, a directory in the way,
    no write permission, or a file the system refuses to open for writing (``/proc``, ``/sys``, a read-only
    mount: tried, and removed again where it did not exist) are the problems found.
    """
    if _standard_stream(path) is not None:  # written through the stream (write_output)
        return None
    target = Path(os.path.realpath(path))  # a symbolic link's target: probed, and removed if made, not the link
    if target.is_dir():
        return "is a directory"
    parent = target.parent if str(target.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        return f"{parent} is not a folder"
    if not parent.is_dir():
        return f"its folder {parent} does not exist"
    if target.exists() and not os.access(target, os.W_OK):
        return "exists and is not writable"
    if not target.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"its folder {parent} is not writable"
    if target.exists() and not target.is_file():  # a device or a FIFO (/dev/stdout): opening it may wait or act
        return None
    existed = target.exists()
    try:
        with open(target, "a", encoding="utf-8"):  # appends nothing, truncates nothing
            pass
    except OSError as e:
        return f"cannot be written ({e.strerror or e})"
    if not existed:
        target.unlink(missing_ok=True)
    return None


def write_output(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) as the file ``path`` (a symbolic link's target), whole or not at all.

    Where the file exists, the text is written beside it and renamed over it (its mode kept), so a write that
    fails part-way (a full disk) leaves it as it was; a new file is removed again if its write fails.
    Written in place instead, where a rename would change what the name stands for or cannot be made: a
    FIFO or device, a file with other hard links or another owner, a folder that refuses a new entry or the
    rename (another user's sticky folder). Standard output or error (``/dev/stdout``, or the file they are
    redirected to) gets the text through ``sys.stdout``/``sys.stderr`` (:func:`_standard_stream`).

    Raises:
        OSError: the write failed (``filename`` is ``path``'s target, never a temporary name).
        UnicodeEncodeError: ``text`` holds a lone surrogate; nothing was written.
    """
    stream = _standard_stream(path)
    if stream is not None:
        stream.write(text)
        stream.flush()
        return
    target = os.path.realpath(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        _write_new(target, text)
        return
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or st.st_uid != os.geteuid():
        _write_in_place(target, text)
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", dir=os.path.dirname(target))
    except PermissionError:
        _write_in_place(target, text)
        return
    try:
        with open(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, target)
    except PermissionError:  # the rename, in a sticky folder: the file as it was, written in place
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _write_in_place(target, text)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OSError(e.errno, e.strerror, target) from e
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_new(target: str, text: str) -> None:
    """``target`` created (its mode from the umask, as any new file) and written; removed if the write fails."""
    out = open(target, "x", encoding="utf-8")  # noqa: SIM115  (closed below, removed on failure)
    try:
        with out:
            out.write(text)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(target)
        raise


def _write_in_place(target: str, text: str) -> None:
    """``target`` truncated and written (where a rename over it is not possible or would change it)."""
    with open(target, "w", encoding="utf-8") as out:
        out.write(text)


def output_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be used as an output folder (``None`` when it can), creating it (and its
    parents) if missing, before anything is measured: a run of minutes must not end unable to write.
    Shared by ``bench --trace`` and ``bench --plot``."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        return "exists and is not a folder"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror or e})"
    return None if os.access(target, os.W_OK | os.X_OK) else "is not writable"
