"""Engram store over 4 gloo ranks: tp=4 vs tp=1 and shared vs private lookups bit for bit
(idle ranks included), private RSS per rank, one shared copy per node, crash reclaim."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from loader_fixtures import (kill_all, run_world, start_world, tiny_cfg, vm_hwm_bytes,
                             write_checkpoint)

from sglang_dsv41.loader.engram_store import install_engram_tables
from sglang_dsv41.model import build_model
from sglang_dsv41.model.engram import engram_rows, ngram_window_from_packed

WORLD = 4
pytestmark = pytest.mark.timeout(120)


def _rows_for(rank: int, step: int, cfg) -> torch.Tensor:
    """Random token histories of one rank at one step; rank 3 and step 1 of rank 0 are idle."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    lens = [] if rank == 3 or (rank, step) == (0, 1) else \
        torch.randint(1, 9, (1 + rank,), generator=gen).tolist()
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=gen)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    window = ngram_window_from_packed(ids, cu, cfg.max_ngram_order)
    return engram_rows(window, cfg.engram_ngram_orders, cfg.engram_num_hash_heads,
                       cfg.engram_num_rows)


def _vm_rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _hold_worker(rank, world, path, marker_dir):
    model = build_model(tiny_cfg(), torch.float32)
    install_engram_tables(model, path, "shared", rank, world, namespace="killed")
    open(os.path.join(marker_dir, f"ready{rank}"), "w").close()
    signal.pause()  # killed by the test with SIGKILL: no cleanup runs


def _lookups(rank, world, path, shm_dir, layout):
    cfg = tiny_cfg()
    model = build_model(cfg, torch.float32)
    handle = install_engram_tables(model, path, layout, rank, world, namespace="second")
    table = model.model.layers[1].engram.table
    files = sorted(os.listdir(shm_dir))
    got = [table.lookup(_rows_for(rank, step, cfg)).view(torch.int32) for step in range(3)]
    out = {"lookups": got, "checksum": table.checksum(), "files": files,
           "resident": handle.resident_bytes}
    handle.close()
    return out


def _private_rss(rank, world, big_path):
    from sglang_dsv41.loader.engram_source import find_engram_tables
    from sglang_dsv41.loader.engram_store import PrivateEngramTable

    # the lookups above warmed up the code pages and gloo buffers, which are not table costs
    source = find_engram_tables(big_path)["model.layers.0.engram.table.weight"]
    rss_before = _vm_rss_bytes()
    table = PrivateEngramTable(source, rank, world)
    rows = torch.randint(0, source.num_rows, (2048,), generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        got = table.lookup(rows)
    growth = vm_hwm_bytes() - rss_before  # >= the true peak growth
    return {"growth": growth, "shard": table.resident_bytes, "rows": rows[:64],
            "got": got[:64].view(torch.int32)}


def _main_worker(rank, world, path, shm_dir, big_path):
    return {"shared": _lookups(rank, world, path, shm_dir, "shared"),
            "private": _lookups(rank, world, path, shm_dir, "private"),
            "rss": _private_rss(rank, world, big_path)}


BIG_ROWS, BIG_DIM = 1 << 20, 128  # 256 MiB of bf16, 64 MiB per rank
BIG_NAME = "model.layers.0.engram.table.weight"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-rank server killed with SIGKILL, then a 4-rank start in the same shm directory."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("engram_dist")
    shm, markers, big = root / "shm", root / "markers", root / "big"
    for d in (shm, markers, big):
        os.makedirs(d)
    old_env = os.environ.get("SGLANG_DSV41_SHM_DIR")
    os.environ["SGLANG_DSV41_SHM_DIR"] = str(shm)
    try:
        path = str(root / "ckpt")
        write_checkpoint(path, tiny_cfg(), "fp8")
        table = torch.randint(-2**15, 2**15, (BIG_ROWS, BIG_DIM), dtype=torch.int16)
        save_file({BIG_NAME: table.view(torch.bfloat16)}, str(big / "model.safetensors"))
        del table
        procs, _ = start_world(_hold_worker, 2, (path, str(markers)))
        try:
            deadline = time.time() + 60
            while len(os.listdir(markers)) < 2 and time.time() < deadline:
                time.sleep(0.2)
            held = sorted(os.listdir(shm))
        finally:
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
            kill_all(procs)
        after_kill = sorted(os.listdir(shm))
        results = run_world(_main_worker, WORLD, (path, str(shm), str(big)), timeout=100)
        yield {"path": path, "held": held, "after_kill": after_kill, "results": results,
               "after_stop": sorted(os.listdir(shm)), "big": str(big)}
    finally:
        if old_env is None:
            os.environ.pop("SGLANG_DSV41_SHM_DIR", None)
        else:
            os.environ["SGLANG_DSV41_SHM_DIR"] = old_env


def test_tp4_lookups_equal_tp1_under_both_layouts(run):
    cfg = tiny_cfg()
    model = build_model(cfg, torch.float32)
    handle = install_engram_tables(model, run["path"], "private")  # tp=1
    ref = model.model.layers[1].engram.table
    for rank, res in enumerate(run["results"]):
        for step in range(3):
            want = ref.lookup(_rows_for(rank, step, cfg)).view(torch.int32)
            for layout in ("shared", "private"):
                assert torch.equal(res[layout]["lookups"][step], want), (rank, step, layout)
        assert res["private"]["resident"] < handle.resident_bytes / 2
        assert res["shared"]["checksum"] == res["private"]["checksum"] == ref.checksum()
    assert run["results"][3]["shared"]["lookups"][0].numel() == 0  # the idle rank took part
    handle.close()


def test_private_rank_holds_only_its_shard(run):
    from safetensors import safe_open

    with safe_open(os.path.join(run["big"], "model.safetensors"), "pt") as f:
        full = f.get_slice(BIG_NAME)
        for res in (r["rss"] for r in run["results"]):
            assert res["shard"] == BIG_ROWS * BIG_DIM * 2 // WORLD
            ratio = res["growth"] / res["shard"]
            print(f"private RSS growth {res['growth'] / 2**20:.1f} MiB for a "
                  f"{res['shard'] / 2**20:.0f} MiB shard: {ratio:.3f}x")
            assert ratio <= 1.2
            for i, r in enumerate(res["rows"].tolist()):
                want = full[r:r + 1].float().view(torch.int32)[0]
                assert torch.equal(res["got"][i], want)  # random bits: NaNs survive the gather


def test_one_shared_copy_and_nothing_left_after_sigkill_and_restart(run):
    assert [f for f in run["held"] if ".seg-" in f] == ["sgldsv41-killed.seg-t0"]
    assert sum(".lease-" in f for f in run["held"]) == 2  # the reference count
    assert "sgldsv41-killed.seg-t0" in run["after_kill"]  # a crash leaves it behind ...
    for res in run["results"]:  # ... the next start reclaims it and holds one copy for 4 ranks
        assert [f for f in res["shared"]["files"] if ".seg-" in f] == ["sgldsv41-second.seg-t0"]
        assert sum(".lease-" in f for f in res["shared"]["files"]) == WORLD
        assert not [f for f in res["private"]["files"] if ".seg-" in f]
    assert run["after_stop"] == []  # and a clean stop leaves nothing
