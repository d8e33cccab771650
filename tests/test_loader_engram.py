"""Engram host layouts in one process: the shared layout maps one shared-memory copy and serves
the same rows; the layout policy by node count; shared-memory leases and crash reclaim. The
row-sharded (per_rank) layout runs across ranks in tests/test_engine_core_ranks.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from engine_core_harness import engine_test_model
from sglang_dsv41.loader.engram_codec import tensor_checksum
from sglang_dsv41.loader.engram_layouts import engram_tables, install_engram_layout
from sglang_dsv41.loader.shm import ShmNamespace, reclaim_stale
from sglang_dsv41.model.dsv4.context import DSV4Context


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("SGLANG_DSV41_SHM_DIR", str(d))
    return d


def test_shared_layout_maps_one_copy_and_serves_the_same_rows(shm_dir):
    _, model = engine_test_model()
    ids = torch.tensor([(3 * i + 1) % 256 for i in range(30)])
    with torch.no_grad():
        want = model(ids, DSV4Context.packed([30]))
    sums = {n: tensor_checksum(t.weight) for n, t in engram_tables(model).items()}
    handle = install_engram_layout(model, "shared", None, "one")
    segments = sorted(f for f in os.listdir(shm_dir) if ".seg-" in f)
    assert len(segments) == 2 and handle.layout == "shared"
    for name, table in engram_tables(model).items():
        assert table.weight.untyped_storage().nbytes() == sum(  # a view of the whole segment
            os.path.getsize(shm_dir / s) for s in segments if name.replace(".", "_") in s)
        assert tensor_checksum(table.weight) == sums[name]
    with torch.no_grad():
        assert torch.equal(model(ids, DSV4Context.packed([30])), want)
    handle.close()
    assert os.listdir(shm_dir) == []   # the last lease removed the namespace


def test_layout_policy_by_node_count():
    from sglang_dsv41.policies.engram_layout import EngramLayoutError
    from sglang_dsv41.server_args import ServerArgs

    assert ServerArgs(tp_size=16, nnodes=2).resolved_engram_layout == "private"
    assert ServerArgs(tp_size=8).resolved_engram_layout == "shared"
    with pytest.raises((EngramLayoutError, ValueError), match="other nodes"):
        ServerArgs(tp_size=16, nnodes=2, engram_layout="shared").resolved_engram_layout
    _, model = engine_test_model()
    with pytest.raises(ValueError, match="unknown Engram layout"):
        install_engram_layout(model, "per_node", None, "x")


def _hold_lease(directory, namespace, ready):
    os.environ["SGLANG_DSV41_SHM_DIR"] = directory
    ns = ShmNamespace(namespace)
    ns.acquire_lease()
    tmp, mm = ns.create_segment("t0", 4096)
    mm.close()
    ns.publish(tmp, "t0")
    ready.set()
    signal.pause()


@pytest.mark.timeout(60)
def test_segments_of_a_killed_owner_are_reclaimed(shm_dir):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_lease, args=(str(shm_dir), "crashed", ready), daemon=True)
    p.start()
    try:
        assert ready.wait(30)
        assert reclaim_stale() == []  # its owner is alive: not stale
        assert any(".seg-t0" in f for f in os.listdir(shm_dir))
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
    removed = reclaim_stale()
    assert any(".seg-t0" in f for f in removed) and os.listdir(shm_dir) == []


def test_leases_count_references(shm_dir):
    a, b = ShmNamespace("rc"), ShmNamespace("rc")
    a.acquire_lease()
    tmp, mm = a.create_segment("x", 100)
    mm.close()
    a.publish(tmp, "x")
    # a second holder in this process stands for another local rank (same pid, so fake it)
    b._lease = f"{b.base}.lease-{os.getpid()}b"
    os.link(a._lease, b._lease)
    assert not a.release_lease()  # b still holds it
    assert os.path.exists(a.segment_path("x"))
    assert b.release_lease() and os.listdir(shm_dir) == []


def test_lock_holds_when_a_release_unlinks_the_lock_file(shm_dir):
    # A release removes the namespace, lock file included. Whoever waited on that file must
    # not end up holding a lock on a file nobody else opens: the next comer would take the new
    # file's lock beside it (two ranks in the namespace at once: segments deleted under a rank
    # that had just published them).
    import threading

    ns = ShmNamespace("lk")
    entered, release = threading.Event(), threading.Event()

    def waiter():
        with ns.locked():
            entered.set()
            release.wait(10)

    with ns.locked():
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)  # the waiter blocks on this lock file
        ns._remove_all()
    assert entered.wait(10)
    with pytest.raises(BlockingIOError):  # the waiter holds the lock at the path now
        with ns.locked(blocking=False):
            pass
    release.set()
    t.join(10)
