"""Writing files so that a killed process leaves the old file or the new one.

The file is written under a temporary name beside the target (same folder, so
the same file system), flushed to disk, and renamed over the target with
`os.replace`, which POSIX and Windows make atomic. A target that is a link is
written through: the temporary goes beside the file it names, which the rename
replaces, and the link stays. A process killed before the
rename leaves only a temporary behind; `remove_stale_temporaries` clears those
whose writer is gone. The new file keeps the old one's permissions. A write that fails (a full disk, a read-only or vanished
folder) leaves the target as it was and raises an `OSError` that says so,
names the target (not the temporary) and says what to do.

Ctrl-C during a write is held back until the write ends: Python loses a
KeyboardInterrupt raised inside a finalizer ("Exception ignored in"), and
Keras' save runs some (zipfile's `__del__`), so a Ctrl-C landing there would
let training go on. A second Ctrl-C stops the write at once.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import shutil
import signal
import socket
import threading
import uuid

_MARK = ".kerasmulti-tmp-"
_NAME_MAX = 255  # bytes in a file name on ext4, XFS, btrfs, APFS and NTFS


def _suffix(path: str) -> str:
    # Keras picks the format from the name: keep every suffix it looks at.
    for suffix in (".weights.h5", ".keras", ".h5", ".json"):
        if path.endswith(suffix):
            return suffix
    return os.path.splitext(path)[1]


def temporary_path(target: str, suffix: str | None = None) -> str:
    """A temporary beside `target`, ending with `suffix` (by default the target's: Keras picks the format from it)."""
    folder, name = os.path.split(os.path.abspath(target))
    # The writer's pid and host: a folder may be shared by several machines.
    writer = f"{_MARK}{os.getpid()}@{socket.gethostname()}-{uuid.uuid4().hex[:8]}{_suffix(name) if suffix is None else suffix}"
    # Any name Keras can write gets a temporary that fits too: the target's name is cut short to fit.
    room = _NAME_MAX - 1 - len(os.fsencode(writer))
    return os.path.join(folder, "." + os.fsencode(name)[:room].decode("utf-8", "ignore") + writer)


def _keep_mode(target: str, temporary: str) -> None:
    """The file replaced keeps its permissions (a group-writable checkpoint stays so), as a write in place would."""
    try:
        shutil.copymode(target, temporary)
    except FileNotFoundError:  # a new file: the umask's mode, as Keras gives it
        pass


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(target: str, save, caller: str, received: str, then: str = "") -> None:
    """Calls `save(temporary_path)`, then moves the result onto `target`.

    If `save` raises, the temporary is removed and `target` is untouched; an
    `OSError` comes back as one that says so, in `caller`'s name, ending with
    `then` (what the user can do next) and `Received: {received}`.
    """
    try:
        # A link is written through, as Keras does: the rename replaces the file it names.
        real = os.path.realpath(target, strict=True) if os.path.islink(target) else os.path.realpath(target)
    except FileNotFoundError:  # a link to a file not made yet
        real = os.path.realpath(target)
    except OSError as error:  # a loop of links, which Keras cannot write either
        raise _failed(error, target, target, caller, received, then) from error
    # In the name the user gave: the file a link names may have no suffix, and Keras picks the format from it.
    temporary = temporary_path(real, _suffix(os.path.basename(target)))
    try:
        os.makedirs(os.path.dirname(temporary), exist_ok=True)
    except OSError as error:  # EEXIST here: a file where a folder of the path should be
        code = errno.ENOTDIR if error.errno == errno.EEXIST else error.errno
        raise _failed(error, temporary, target, caller, received, then, code) from error
    try:
        with _ctrl_c_held():
            save(temporary)
            _keep_mode(real, temporary)
            _fsync(temporary)
            os.replace(temporary, real)
    except BaseException as error:
        try:
            if os.path.exists(temporary):
                os.remove(temporary)
        except OSError:  # a folder turned read-only: the temporary stays, ignored by readers
            pass
        if isinstance(error, OSError):
            raise _failed(error, temporary, target, caller, received, then) from error
        raise
    try:
        _fsync(os.path.dirname(real))
    except OSError:  # some file systems cannot sync a folder; the rename stands
        pass


@contextlib.contextmanager
def _ctrl_c_held():
    """Raises the KeyboardInterrupt of a Ctrl-C pressed inside the block as it ends; a second one at once."""
    held = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if not held:  # another thread, or the user's own SIGINT handler: theirs to keep
        yield
        return
    pressed = []

    def hold(signum, frame):
        pressed.append(signum)
        if len(pressed) > 1:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if pressed:  # also when the write failed: the user asked to stop (the failure is its context)
            raise KeyboardInterrupt


_FIXES = {
    errno.ENOSPC: "Free some space on that disk, or write to another one.",
    errno.EDQUOT: "Free some of your disk quota, or write to another disk.",
    errno.EROFS: "Its file system is read-only: remount it writable, or write to another folder.",
    errno.EACCES: "Make the folder writable for this user, or write to another folder.",
    errno.EPERM: "Make the folder writable for this user, or write to another folder.",
    errno.ENOENT: "Its folder was removed while the file was written: keep it in place while the job runs.",
    errno.ENOTDIR: "A file stands where a folder of its path should be: remove it, or write to another folder.",
}


def _failed(error: OSError, temporary: str, target: str, caller: str, received: str, then: str, code=None) -> OSError:
    """The error to raise for a failed write: what failed, that nothing was lost, the fix."""
    code = code or error_code(error)
    # h5py's errors name the temporary: the user knows only the target.
    reason = os.strerror(code) if code else " ".join(str(error).replace(temporary, target).split())[:300]
    fix = fix_for(code)
    if code == errno.ENOENT and os.path.isdir(os.path.dirname(temporary)):  # the folder is there, yet took no file
        fix = "Its folder takes no new files (a special file system, such as /proc): write to another folder."
    message = (
        f"{caller} could not write '{target}' ({reason}). The file that was there before, if any, "
        f"is kept as it was, and no partial file is left in its place. {fix} {then}".rstrip()
    )
    message += f" Received: {received}"
    return OSError(code, message) if code else OSError(message)  # OSError(code, ...) picks its subclass


def error_code(error: OSError) -> int | None:
    """The system's error number, also where h5py gives it only in its text (`errno = 28`)."""
    if error.errno:
        return error.errno
    found = re.search(r"errno = (\d+)", str(error))
    return int(found.group(1)) if found else None


def fix_for(code: int | None) -> str:
    """What the user can do about a failed write with this error number."""
    return _FIXES.get(code, "Check the disk and the folder.")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(target: str) -> list[str]:
    """Deletes temporaries of `target` (beside the file a link names) left by processes of this host that no longer run."""
    return remove_stale_temporaries_in(os.path.dirname(os.path.realpath(target)))


def remove_stale_temporaries_in(folder: str) -> list[str]:
    """Deletes the temporaries in `folder` left by processes of this host that no longer run."""
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
            except OSError:  # gone already, or another user's in a shared folder: theirs to remove
                pass
    return removed
