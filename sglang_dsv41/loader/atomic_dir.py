"""Write a directory atomically: build it in a hidden sibling, swap it into place when done.

A process killed midway leaves only the hidden sibling (``.<name>.tmp-<pid>@<host>-<id>``),
never a half-written ``<name>``; the next writer of the same output removes siblings whose
process is gone (only its own host's: on a shared filesystem another host's writer may be
alive). Publishing is one atomic exchange of the two directories (renameat2 RENAME_EXCHANGE on
Linux). Where the filesystem cannot exchange, it is two renames (``<name>`` to
``.<name>.old-...``, then the staged copy to ``<name>``); a writer killed between them leaves no
``<name>``, and the next writer puts the complete copy back before it cleans anything
(recover_interrupted_publish). Every rename stays on one filesystem, so each is atomic.

What a writer may replace (check_output_dir): an absent or empty directory, or one this module
published (it holds OUTPUT_MARKER); anything else only when forced. The output may never be, hold
or lie inside one of the sources it is made from, whatever path (symlinks included) names it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from typing import Iterable, Iterator

STAGING_TAG = ".tmp-"
OLD_TAG = ".old-"
# A directory on its way to deletion: renamed here whole first, so a half-deleted tree never
# carries a name that recovery would restore.
TRASH_TAG = ".del-"
# Written last into a staged copy, just before it is published: a directory holding it is a
# complete output of this module (and may be replaced without --force).
OUTPUT_MARKER = ".sglang_dsv41_output"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_HOST = socket.gethostname()


def _sibling(out_dir: str, tag: str) -> str:
    parent, base = os.path.split(os.path.abspath(out_dir))
    return os.path.join(parent, f".{base}{tag}{os.getpid()}@{_HOST}-{uuid.uuid4().hex[:8]}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_siblings(out_dir: str, tag: str) -> list[str]:
    """Siblings of ``out_dir`` with ``tag`` whose writing process, on this host, no longer
    runs (a sibling without a host is taken as this host's)."""
    parent, base = os.path.split(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        return []
    prefix = f".{base}{tag}"
    out = []
    for entry in os.listdir(parent):
        if entry.startswith(prefix):
            pid, _, host = entry[len(prefix):].rsplit("-", 1)[0].partition("@")
            if host not in ("", _HOST):
                continue  # another host's writer: whether it runs cannot be told from here
            if pid.isdigit() and not pid_alive(int(pid)):
                out.append(os.path.join(parent, entry))
    return out


def recover_interrupted_publish(out_dir: str) -> str | None:
    """Put ``out_dir`` back when a writer died between the two renames of a publish without
    exchange: the previous output (an ``.old-`` sibling, moved aside whole by one rename), else
    a staged copy that was sealed (holds OUTPUT_MARKER, written last). Returns the sibling that
    was restored, or None. Never deletes anything: cleaning comes after."""
    if os.path.lexists(out_dir):
        return None
    complete = _dead_siblings(out_dir, OLD_TAG) or [
        p for p in _dead_siblings(out_dir, STAGING_TAG)
        if os.path.isfile(os.path.join(p, OUTPUT_MARKER))]
    if not complete:
        return None
    newest = max(complete, key=os.path.getmtime)
    try:
        os.rename(newest, out_dir)
    except FileNotFoundError:  # another writer restored it first
        return None
    return newest


def clean_stale_siblings(out_dir: str) -> list[str]:
    """Remove staging/old siblings of ``out_dir`` left by processes that no longer run, after
    restoring ``out_dir`` from one of them if it is missing (the only complete copy is kept)."""
    recover_interrupted_publish(out_dir)
    removed = []
    for tag in (STAGING_TAG, OLD_TAG, TRASH_TAG):
        for path in _dead_siblings(out_dir, tag):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(os.path.basename(path))
    return removed


def write_file_atomically(path: str, text: str) -> None:
    """``text`` into ``path`` through a synced sibling ``.tmp`` file renamed over it: a reader
    (or a crash) sees the old file or the new one, never half of one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _inside(path: str, root: str) -> bool:
    return path != root and os.path.commonpath([path, root]) == root


def is_replaceable(out_dir: str) -> bool:
    """Absent, an empty directory, or a complete output of this module."""
    if not os.path.lexists(out_dir):
        return True
    return os.path.isdir(out_dir) and (not os.listdir(out_dir) or
                                       os.path.isfile(os.path.join(out_dir, OUTPUT_MARKER)))


def _foreign(out_dir: str) -> ValueError:
    return ValueError(f"output {out_dir} is a non-empty directory that this tool did not write "
                      f"(it has no {OUTPUT_MARKER}); pass --force to replace it, deleting "
                      "everything in it")


def check_output_dir(out_dir: str, sources: Iterable[str] = (), force: bool = False) -> str:
    """The real path to publish ``out_dir`` at, after refusing (ValueError) an output that is a
    symlink, whose parent is not a directory, that is, holds or lies inside a source, that
    exists and is not a directory, or that is a non-empty directory this module did not write
    (unless ``force``). Creates and deletes nothing: call it before any work."""
    out = os.path.abspath(out_dir)
    if os.path.islink(out):
        # Publishing renames onto the path: it would replace the link, not fill its target.
        raise ValueError(f"output {out_dir} is a symlink (to {os.path.realpath(out)}): give "
                         "the directory's own path")
    ancestor = os.path.dirname(out)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"cannot create output {out_dir}: {ancestor} is not a directory")
    # Compare real paths: a symlinked parent must not hide that DST is (or holds) SRC.
    real = os.path.join(os.path.realpath(os.path.dirname(out)), os.path.basename(out))
    for src in sources:
        s = os.path.realpath(src)
        if s == real:
            raise ValueError(f"output {out_dir} is the source {src}: DST must differ from SRC")
        if _inside(s, real):
            raise ValueError(f"output {out_dir} contains the source {src}: replacing it would "
                             "delete the source")
        if _inside(real, s):
            raise ValueError(f"output {out_dir} lies inside the source {src}: give a path "
                             "outside it")
    if os.path.lexists(real) and not os.path.isdir(real):
        raise ValueError(f"output {out_dir} exists and is not a directory")
    if not force and not is_replaceable(real):
        raise _foreign(out_dir)
    return real


def os_error_text(e: OSError) -> str:
    """One line for a filesystem error, naming the path(s) when the error has them."""
    text = e.strerror or str(e)
    paths = [p for p in (e.filename, e.filename2) if p is not None]
    return f"{text}: {' -> '.join(map(str, paths))}" if paths else str(e)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE). False where the platform or the
    filesystem cannot; the caller then falls back to two renames."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28 or another libc
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _delete_dir(path: str, out_dir: str) -> None:
    """Rename ``path`` to a trash sibling (atomic) and delete it there."""
    trash = _sibling(out_dir, TRASH_TAG)
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


class StagedDir:
    """A hidden sibling of ``out_dir`` to write into; ``publish`` swaps it onto ``out_dir``.

    ``out_dir`` is checked first (check_output_dir: never a source, a symlink or, unless
    ``force``, a directory this module did not write)."""

    def __init__(self, out_dir: str, sources: Iterable[str] = (), force: bool = False):
        self.sources, self.force = tuple(sources), force
        self.out_dir = check_output_dir(out_dir, self.sources, force)
        os.makedirs(os.path.dirname(self.out_dir), exist_ok=True)
        clean_stale_siblings(self.out_dir)
        check_output_dir(self.out_dir, self.sources, force)  # again: recovery may restore it
        self.path = _sibling(self.out_dir, STAGING_TAG)
        os.makedirs(self.path)

    def publish(self) -> None:
        """Move the staged directory into place, replacing ``out_dir``. On any error the staged
        copy is discarded and ``out_dir`` is left as it was."""
        try:
            self._publish()
        except BaseException:
            self.discard()
            raise

    def _publish(self) -> None:
        # The marker vouches for every file: each reaches the disk before it does (a writer
        # may not have synced its own, e.g. config.json or what save_pretrained wrote).
        for root, _, files in os.walk(self.path):
            for name in files:
                _fsync_path(os.path.join(root, name))
        with open(os.path.join(self.path, OUTPUT_MARKER), "w") as f:
            json.dump({"writer": "sglang_dsv41", "pid": os.getpid(), "time": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(self.path)
        try:
            os.rename(self.path, self.out_dir)  # succeeds when out_dir is absent or empty
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Checked again: the directory may have been filled while the output was written.
            if not self.force and not is_replaceable(self.out_dir):
                raise _foreign(self.out_dir) from None
            if _exchange(self.path, self.out_dir):
                _delete_dir(self.path, self.out_dir)  # it now holds the previous output
            else:
                old = _sibling(self.out_dir, OLD_TAG)
                os.rename(self.out_dir, old)
                try:
                    os.rename(self.path, self.out_dir)
                except BaseException:
                    os.rename(old, self.out_dir)
                    raise
                _delete_dir(old, self.out_dir)
        _fsync_path(os.path.dirname(self.out_dir))

    def discard(self) -> None:
        # Through the trash: a sealed copy half deleted must not be restored by recovery.
        _delete_dir(self.path, self.out_dir)


@contextmanager
def staged_output(out_dir: str, sources: Iterable[str] = (),
                  force: bool = False) -> Iterator[str]:
    """``with staged_output(d) as tmp:`` write into tmp; on success tmp becomes d, on an
    exception tmp is removed and d is left as it was."""
    staged = StagedDir(out_dir, sources, force)
    try:
        yield staged.path
    except BaseException:
        staged.discard()
        raise
    staged.publish()
