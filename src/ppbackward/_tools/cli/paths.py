"""Private: output paths of the commands: checked before anything runs, and written when the run ends
(``check --json``, ``bench --json``, ``bench --trace``, ``bench --plot``, ``check --markdown``).

Standard library only, so that a bad path is refused before torch's heavier modules are imported.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import sys
import tempfile
from pathlib import Path

__all__ = ["output_dir_problem", "output_file_problem", "write_output", "written"]


_FD_PATH = re.compile(r"/(?:dev|proc/self)/fd/(\d+)")
_STD_PATHS = {"/dev/stdout": 1, "/dev/stderr": 2}


def _descriptor(path: str) -> int | None:
    """The open descriptor of this process that ``path`` stands for, or ``None``: ``/dev/stdout``,
    ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N`` (a shell's ``>(...)`` or ``3>>log``), or the file or
    pipe that descriptor 1 or 2 is, under any name (``--json run.log > run.log``). Such a path is written to
    the descriptor, after Python's buffered output, never reopened: a reopened redirected file would be
    truncated or renamed over, and a pipe's name does not resolve."""
    fd = _STD_PATHS.get(path)
    if fd is not None:
        return fd
    found = _FD_PATH.fullmatch(path)
    if found:
        return int(found.group(1))
    try:
        st = os.stat(path)
    except OSError:
        return None
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.path.samestat(st, os.fstat(fd)):
                return fd
    return None


def output_file_problem(path: str) -> str | None:
    """Why ``path`` cannot be written as an output file (``None`` when it can); nothing it creates stays.

    Shared by ``check --json``/``--markdown`` and ``bench --json``; a missing folder, a directory in the way,
    no write permission, or a file the system refuses to open for writing (``/proc``, ``/sys``, a read-only
    mount: tried, and removed again where it did not exist) are the problems found.
    """
    fd = _descriptor(path)
    if fd is not None:  # written to the descriptor (write_output)
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            return f"names descriptor {fd}, which is not open"
        return "names a descriptor not open for writing" if flags & os.O_ACCMODE == os.O_RDONLY else None
    with contextlib.suppress(OSError):
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            return "is a directory"
        if not stat.S_ISREG(mode):  # a device or a FIFO: opening it may wait or act
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
    FIFO or device, a file with other hard links, another owner or another group than a new file gets,
    extended attributes other than a new file's (an ACL: :func:`_xattrs_differ`), a folder that refuses a new entry or
    the rename (another user's sticky folder). A path naming one of this
    process's descriptors (standard output, ``/dev/fd/N``: :func:`_descriptor`) gets the text on that
    descriptor, after ``sys.stdout`` and ``sys.stderr`` are flushed.

    Raises:
        OSError: the write failed (``filename`` is ``path``'s target, never a temporary name).
        UnicodeEncodeError: ``text`` holds a lone surrogate; nothing was written.
    """
    fd = _descriptor(path)
    if fd is not None:
        data = memoryview(text.encode("utf-8"))
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a replaced or closed stream: nothing of ours to flush
                stream.flush()
        while data:
            data = data[os.write(fd, data):]
        return
    try:
        st = os.stat(path)
    except FileNotFoundError:
        _write_new(os.path.realpath(path), text)
        return
    target = os.path.realpath(path)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or st.st_uid != os.geteuid():
        _write_in_place(target, text)
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", dir=os.path.dirname(target))
    except PermissionError:
        _write_in_place(target, text)
        return
    except OSError as e:
        raise OSError(e.errno, e.strerror, target) from e
    try:
        os.fchmod(fd, stat.S_IMODE(st.st_mode))  # first: an ACL attribute holds the mode bits
        # a rename would change the file's group or its extended attributes (an ACL): written in place
        in_place = os.fstat(fd).st_gid != st.st_gid or _xattrs_differ(target, tmp)
    except OSError:
        in_place = True
    if in_place:
        os.close(fd)
        os.unlink(tmp)
        _write_in_place(target, text)
        return
    try:
        with open(fd, "w", encoding="utf-8") as out:
            out.write(text)
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


def _xattrs_differ(target: str, new: str) -> bool:
    """Whether the new file ``new`` (given ``target``'s mode) carries other extended attributes than ``target``
    (an ACL is ``system.posix_acl_access``; one of the folder's default ACL is inherited), so that renaming it
    over ``target`` would change them; those every new file gets alike (an SELinux label from the folder) are
    no reason. ``False`` where the system has none (no ``os.listxattr`` off Linux, or unsupported); ``True``
    where the new file's cannot be read (written in place, the file as it was)."""
    try:
        names = os.listxattr(target)
    except (OSError, AttributeError):
        return False
    try:
        if sorted(os.listxattr(new)) != sorted(names):
            return True
        return any(os.getxattr(new, name) != os.getxattr(target, name) for name in names)
    except OSError:
        return True


def written(command: str, option: str, path: str, text: str) -> bool:
    """:func:`write_output` as the commands do it when their run ends: ``False``, with one line on stderr
    (``ppbackward COMMAND: error: OPTION PATH: why``), where the write fails; the path was writable when
    checked before the run (:func:`output_file_problem`)."""
    try:
        write_output(path, text)
    except OSError as e:
        print(f"ppbackward {command}: error: {option} {path}: {e.strerror or e}", file=sys.stderr)
        return False
    return True


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
