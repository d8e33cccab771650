"""Engram store in one process: layouts, fp8 dequant, checksums, shared-memory lifecycle."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch
from loader_fixtures import tiny_cfg, write_checkpoint

from sglang_dsv41.loader.engram_codec import shard_range, source_checksum, tensor_checksum
from sglang_dsv41.loader.engram_source import ALIGN_ROWS, find_engram_tables
from sglang_dsv41.loader.engram_store import install_engram_tables
from sglang_dsv41.loader.fp8 import dequantize_fp8_blocks, scale_name
from sglang_dsv41.loader.shm import ShmNamespace, reclaim_stale
from sglang_dsv41.model import build_model
from sglang_dsv41.model.engram import EngramTable, ParameterEngramTable

TABLE = "model.layers.1.engram.table.weight"


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def ckpt(request, tmp_path_factory):
    cfg = tiny_cfg(engram_num_rows=1000)  # not a multiple of 128: a ragged last chunk
    path = str(tmp_path_factory.mktemp(f"ckpt_{request.param}"))
    tensors = write_checkpoint(path, cfg, request.param)
    return cfg, path, tensors, request.param


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("SGLANG_DSV41_SHM_DIR", str(d))
    return d


def _reference_table(cfg, tensors, mode) -> ParameterEngramTable:
    """What a full load puts in a float32 model's parameter."""
    w = tensors[TABLE]
    full = (w.float() if mode == "bf16" else
            dequantize_fp8_blocks(w, tensors[scale_name(TABLE)], dtype=torch.float32))
    table = ParameterEngramTable(cfg.engram_num_rows, cfg.engram_dim)
    table.weight.data.copy_(full)
    return table


def test_layouts_match_full_load_bitwise(ckpt, shm_dir):
    cfg, path, tensors, mode = ckpt
    ref = _reference_table(cfg, tensors, mode)
    rows = torch.randint(0, cfg.engram_num_rows, (37, 4))
    rows[0, 0], rows[-1, -1] = 0, cfg.engram_num_rows - 1
    want = ref.lookup(rows)
    for layout in ("shared", "private"):
        model = build_model(cfg, torch.float32)
        handle = install_engram_tables(model, path, layout, namespace="t1")
        table = model.model.layers[1].engram.table
        assert isinstance(table, EngramTable) and type(table).__name__.lower().startswith(layout)
        got = table.lookup(rows)
        assert got.dtype == torch.float32 and got.shape == (37, 4, cfg.engram_dim)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), layout
        assert table.lookup(rows[:0]).shape == (0, 4, cfg.engram_dim)
        assert handle.report[0]["file"].endswith(".safetensors")
        assert handle.report[0]["layout"] == layout
        with pytest.raises(ValueError, match="outside"):
            table.lookup(torch.tensor([cfg.engram_num_rows]))
        handle.close()
        with pytest.raises(RuntimeError, match="closed"):
            table.lookup(rows)
    assert os.listdir(shm_dir) == []


def test_checksum_is_layout_and_storage_independent(ckpt, shm_dir):
    cfg, path, tensors, mode = ckpt
    source = find_engram_tables(path)[TABLE]
    expect = tensor_checksum(tensors[TABLE], tensors.get(scale_name(TABLE)))
    assert source_checksum(source, rows_per_read=ALIGN_ROWS * 3) == expect
    for layout in ("shared", "private"):
        model = build_model(cfg, torch.float32)
        handle = install_engram_tables(model, path, layout, namespace="t2")
        assert model.model.layers[1].engram.table.checksum() == expect
        handle.close()
    changed = tensors[TABLE].clone()
    changed.view(torch.uint8).view(-1)[5] ^= 1
    assert tensor_checksum(changed, tensors.get(scale_name(TABLE))) != expect


def test_shard_ranges_cover_rows_once():
    for rows in (1, 127, 128, 1000, 4096, 100_003):
        for world in (1, 2, 3, 4, 8):
            ranges = [shard_range(rows, r, world) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            for (a, b), (c, _) in zip(ranges, ranges[1:]):
                assert b == c and (a % ALIGN_ROWS == 0 or a == b)


def test_install_refuses_mismatched_checkpoint(ckpt, tmp_path):
    cfg, path, _, _ = ckpt
    with pytest.raises(ValueError, match="model expects"):
        install_engram_tables(build_model(tiny_cfg(engram_num_rows=2048)), path, "private")
    with pytest.raises(ValueError, match="layers.2.engram.table.weight"):
        install_engram_tables(build_model(tiny_cfg(engram_num_rows=1000, engram_layers=[1, 2])),
                              path, "private")
    with pytest.raises(ValueError, match="layout"):
        install_engram_tables(build_model(cfg), path, "numa")


def _hold_lease(directory, namespace, ready):
    os.environ["SGLANG_DSV41_SHM_DIR"] = directory
    ns = ShmNamespace(namespace)
    ns.acquire_lease()
    tmp, mm = ns.create_segment("t0", 4096)
    mm.close()
    ns.publish(tmp, "t0")
    ready.set()
    signal.pause()


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


def test_auto_layout_is_private_across_nodes():
    from sglang_dsv41.loader.engram_store import resolve_layout
    from sglang_dsv41.server_args import ServerArgs

    assert resolve_layout("auto", 8, 8) == "shared" and resolve_layout("auto", 16, 8) == "private"
    assert ServerArgs(tp_size=16, nnodes=2).resolved_engram_layout == "private"
    assert ServerArgs(tp_size=8).resolved_engram_layout == "shared"
