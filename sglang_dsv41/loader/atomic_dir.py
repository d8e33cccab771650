"""Write a directory atomically: build it in a hidden sibling, rename it into place when done.

A process killed midway leaves only the hidden sibling (``.<name>.tmp-<pid>-<id>``), never a
half-written ``<name>``; the next writer of the same output removes siblings whose process is
gone. The rename is atomic because the sibling lives on the same filesystem.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from contextlib import contextmanager
from typing import Iterator

STAGING_TAG = ".tmp-"
OLD_TAG = ".old-"


def _sibling(out_dir: str, tag: str) -> str:
    parent, base = os.path.split(os.path.abspath(out_dir))
    return os.path.join(parent, f".{base}{tag}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_siblings(out_dir: str) -> list[str]:
    """Remove staging/old siblings of ``out_dir`` left by processes that no longer run."""
    parent, base = os.path.split(os.path.abspath(out_dir))
    removed = []
    if not os.path.isdir(parent):
        return removed
    for entry in os.listdir(parent):
        for tag in (STAGING_TAG, OLD_TAG):
            prefix = f".{base}{tag}"
            if not entry.startswith(prefix):
                continue
            pid = entry[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
                removed.append(entry)
    return removed


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StagedDir:
    """A hidden sibling of ``out_dir`` to write into; ``publish`` renames it onto ``out_dir``."""

    def __init__(self, out_dir: str):
        self.out_dir = os.path.abspath(out_dir)
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            raise ValueError(f"output {out_dir} exists and is not a directory")
        os.makedirs(os.path.dirname(self.out_dir), exist_ok=True)
        clean_stale_siblings(self.out_dir)
        self.path = _sibling(self.out_dir, STAGING_TAG)
        os.makedirs(self.path)

    def publish(self, replace: bool = True) -> bool:
        """Move the staged directory into place. With ``replace=False`` an existing non-empty
        ``out_dir`` wins (another process got there first): the staged copy is discarded and
        False is returned."""
        _fsync_dir(self.path)
        try:
            os.rename(self.path, self.out_dir)  # succeeds when out_dir is absent or empty
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            if not replace:
                self.discard()
                return False
            old = _sibling(self.out_dir, OLD_TAG)
            os.rename(self.out_dir, old)
            os.rename(self.path, self.out_dir)
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(os.path.dirname(self.out_dir))
        return True

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@contextmanager
def staged_output(out_dir: str, replace: bool = True) -> Iterator[str]:
    """``with staged_output(d) as tmp:`` write into tmp; on success tmp becomes d, on an
    exception tmp is removed and d is left as it was."""
    staged = StagedDir(out_dir)
    try:
        yield staged.path
    except BaseException:
        staged.discard()
        raise
    staged.publish(replace=replace)
