"""Node-shared memory segments with leases: created once, reference counted, crash-reclaimed.

Files live in /dev/shm (SGLANG_DSV41_SHM_DIR overrides) under one prefix per namespace
(one namespace per server):

    sgldsv41-<ns>.lock           flock serialising create/attach/release of the namespace
    sgldsv41-<ns>.lease-<pid>    one per attached process: {"pid", "start"} (the reference count)
    sgldsv41-<ns>.seg-<key>      the segments

The last process to release its lease unlinks the namespace. A process killed with SIGKILL
leaves its lease behind; a lease whose pid is gone (or was reused: the start time differs) is
dead, and a namespace without a live lease is removed by ``reclaim_stale`` on the next start.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import mmap
import os
import re

from .atomic_dir import pid_alive

PREFIX = "sgldsv41"
_NS_RE = re.compile(r"^[A-Za-z0-9_]+$")


def shm_dir() -> str:
    return os.environ.get("SGLANG_DSV41_SHM_DIR", "/dev/shm")


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _is_alive(lease: dict) -> bool:
    pid = int(lease.get("pid", -1))
    if pid <= 0:
        return False
    if os.path.isdir("/proc"):
        start = _start_time(pid)
        return start is not None and start == lease.get("start")
    return pid_alive(pid)


def _read_lease(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


class ShmNamespace:
    def __init__(self, namespace: str, directory: str | None = None):
        if not _NS_RE.match(namespace):
            raise ValueError(f"shared-memory namespace {namespace!r} must match [A-Za-z0-9_]+")
        self.namespace = namespace
        self.dir = directory or shm_dir()
        self.base = os.path.join(self.dir, f"{PREFIX}-{namespace}")
        self._lease: str | None = None

    def segment_path(self, key: str) -> str:
        if not _NS_RE.match(key):
            raise ValueError(f"segment key {key!r} must match [A-Za-z0-9_]+")
        return f"{self.base}.seg-{key}"

    def files(self) -> list[str]:
        return sorted(glob.glob(glob.escape(self.base) + ".*"))

    @contextlib.contextmanager
    def locked(self, blocking: bool = True):
        """The namespace's flock. The last release unlinks the lock file too, so a process that
        waited on the old file would hold a lock nobody else takes (a second process opens a
        new file at the path): locked only once the path still names the file it locked."""
        path = self.base + ".lock"
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(path).st_ino == os.fstat(fd).st_ino:
                        break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # unlinked while we waited: lock the file now at the path
        try:
            yield
        finally:
            os.close(fd)

    def _live_leases(self) -> list[str]:
        live = []
        for path in glob.glob(glob.escape(self.base) + ".lease-*"):
            if _is_alive(_read_lease(path)):
                live.append(path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return live

    def _remove_all(self) -> list[str]:
        removed = []
        for path in self.files():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
        return removed

    def acquire_lease(self) -> None:
        """Take a reference. The first live holder removes what a crashed run left behind."""
        if self._lease is not None:
            return
        with self.locked():
            if not self._live_leases():
                for path in self.files():
                    if not path.endswith(".lock"):
                        os.unlink(path)
            pid = os.getpid()
            path = f"{self.base}.lease-{pid}"
            with open(path, "w") as f:
                json.dump({"pid": pid, "start": _start_time(pid)}, f)
            self._lease = path

    def release_lease(self) -> bool:
        """Drop the reference; True when it was the last one and the namespace was removed."""
        if self._lease is None:
            return False
        with self.locked():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._lease)
            self._lease = None
            if self._live_leases():
                return False
            self._remove_all()
            return True

    def create_segment(self, key: str, nbytes: int) -> tuple[str, mmap.mmap]:
        """A new writable segment at a temporary name; ``publish`` makes it visible."""
        tmp = f"{self.segment_path(key)}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))  # fail now, not with SIGBUS on a full tmpfs
            return tmp, mmap.mmap(fd, max(nbytes, 1))
        except OSError as e:
            os.unlink(tmp)
            raise ValueError(f"cannot create a {nbytes}-byte shared segment in {self.dir}: {e}")
        finally:
            os.close(fd)

    def publish(self, tmp: str, key: str) -> None:
        os.replace(tmp, self.segment_path(key))

    def attach_segment(self, key: str, writable: bool = False) -> mmap.mmap:
        path = self.segment_path(key)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            return mmap.mmap(fd, size, prot=prot)
        finally:
            os.close(fd)


def reclaim_stale(directory: str | None = None) -> list[str]:
    """Remove every namespace of ours whose processes are all dead; returns removed paths."""
    directory = directory or shm_dir()
    names = set()
    for path in glob.glob(os.path.join(directory, f"{PREFIX}-*")):
        m = re.match(rf"^{PREFIX}-([A-Za-z0-9_]+)\.", os.path.basename(path))
        if m:
            names.add(m.group(1))
    removed = []
    for name in sorted(names):
        ns = ShmNamespace(name, directory)
        try:
            with ns.locked(blocking=False):
                if not ns._live_leases():
                    removed += ns._remove_all()
        except BlockingIOError:
            continue  # somebody is creating or releasing it right now: not stale
    return removed
