"""Private: output paths of the commands, checked before anything runs (``check --json``, ``bench --json``,
``bench --trace``, ``bench --plot``, ``check --markdown``).

Standard library only, so that a bad path is refused before torch's heavier modules are imported.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["output_dir_problem", "output_file_problem", "write_output"]


def output_file_problem(path: str) -> str | None:
    """Why ``path`` cannot be written as an output file (``None`` when it can); nothing it creates stays.

    Shared by ``check --json``/``--markdown`` and ``bench --json``; a missing folder, a directory in the way,
    no write permission, or a file the system refuses to open for writing (``/proc``, ``/sys``, a read-only
    mount: tried, and removed again where it did not exist) are the problems found.
    """
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

    A regular file or a new one is written beside its target and renamed over it (the mode of a file that
    existed is kept; a new one gets the umask's), so a write that fails part-way (a full disk) leaves the
    file as it was; a FIFO or device (``/dev/stdout``) is written directly, and so is a file whose folder
    refuses a new entry (its own permission allowed the check, :func:`output_file_problem`).

    Raises:
        OSError: the write failed; nothing new is left in the folder.
    """
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        umask = os.umask(0)  # read by setting it: there is no other way
        os.umask(umask)
        mode = stat.S_IFREG | (0o666 & ~umask)
    if not stat.S_ISREG(mode):  # a FIFO or a device: no rename over it
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
        os.chmod(tmp, stat.S_IMODE(mode))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_in_place(target: str, text: str) -> None:
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
