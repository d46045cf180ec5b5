"""Writing files so that a killed process leaves the old file or the new one.

The file is written under a temporary name beside the target (same folder, so
the same file system), flushed to disk, and renamed over the target with
`os.replace`, which POSIX and Windows make atomic. A process killed before the
rename leaves only a temporary behind; `remove_stale_temporaries` clears those
whose writer is gone.
"""

from __future__ import annotations

import glob
import os
import socket
import uuid

_MARK = ".kerasmulti-tmp-"


def _suffix(path: str) -> str:
    # Keras picks the format from the name: keep every suffix it looks at.
    for suffix in (".weights.h5", ".keras", ".h5", ".json"):
        if path.endswith(suffix):
            return suffix
    return os.path.splitext(path)[1]


def temporary_path(target: str) -> str:
    folder, name = os.path.split(os.path.abspath(target))
    suffix = _suffix(name)
    # The writer's pid and host: a folder may be shared by several machines.
    return os.path.join(folder, f".{name}{_MARK}{os.getpid()}@{socket.gethostname()}-{uuid.uuid4().hex[:8]}{suffix}")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(target: str, save) -> None:
    """Calls `save(temporary_path)`, then moves the result onto `target`.

    If `save` raises, the temporary is removed and `target` is untouched.
    """
    temporary = temporary_path(target)
    try:
        save(temporary)
        _fsync(temporary)
        os.replace(temporary, target)
    except BaseException as error:
        if os.path.exists(temporary):
            os.remove(temporary)
        if isinstance(error, OSError):
            _name_target(error, temporary, target)
        raise
    try:
        _fsync(os.path.dirname(os.path.abspath(target)))
    except OSError:  # some file systems cannot sync a folder; the rename stands
        pass


def _name_target(error: OSError, temporary: str, target: str) -> None:
    """Makes an error about the temporary name the target: the only file its caller knows."""
    if error.filename == temporary and error.filename2 is None:
        error.filename = target
    elif len(error.args) == 1 and isinstance(error.args[0], str):  # h5py puts the name in its text
        error.args = (error.args[0].replace(temporary, target),)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(target: str) -> list[str]:
    """Deletes temporaries of `target` left by processes of this host that no longer run."""
    folder = os.path.dirname(os.path.abspath(target))
    removed = []
    for path in glob.glob(os.path.join(glob.escape(folder), f".*{_MARK}*")):
        name = os.path.basename(path)
        # <pid>@<host>-<8 hex><suffix>
        writer = name.split(_MARK, 1)[1].removesuffix(_suffix(name)).rpartition("-")[0]
        pid, _, host = writer.partition("@")
        if host != socket.gethostname() or not pid.isdigit():
            continue  # another machine's: whether its writer runs is unknown here
        if int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                os.remove(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed
