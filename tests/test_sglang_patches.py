"""The SGLang patches' own logic, run against boundary objects: small stand-ins with exactly the
attributes each patch reads, for SGLang classes that cannot be imported without CUDA."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import sys
import threading
import time
import types

import pytest

from sglang_dsv41.sglang_backend.patches import dp_attention, dp_routing, watchdog
from sglang_dsv41.sglang_backend.registry import (PatchTargetError, all_patches,
                                                  apply_patches)
from sglang_dsv41.sglang_backend.state import STATE, RankInfo, read_stall_reports
from sglang_dsv41.scheduler.policies import pad_idle_ranks


@pytest.fixture(autouse=True)
def _reset_state():
    yield
    STATE.close()
    STATE.rank, STATE.step, STATE.last_sync = RankInfo(), 0, None


# ---- prefill padding / no zero-token idle rank ----------------------------------------------
class ForwardBatchBoundary:
    """Stands in for sglang ForwardBatch: the patch reads and rewrites global_num_tokens_cpu."""

    def __init__(self, counts):
        self.global_num_tokens_cpu = counts


def test_pad_idle_ranks_policy():
    assert pad_idle_ranks([0, 5, 0], 4) == [4, 5, 4]
    assert pad_idle_ranks([0, 0], 4) == [0, 0]  # nobody has work: nobody runs
    with pytest.raises(ValueError, match="attn_tp_size"):
        pad_idle_ranks([1], 0)


@pytest.mark.parametrize("counts, attn_tp, expected", [
    ([1, 0], 4, [4, 4]),          # health check on rank 0, rank 1 idle
    ([5, 3], 4, [8, 4]),
    ([0, 0], 8, [0, 0]),
    ([7, 0, 9], 1, [7, 1, 9]),
])
def test_forward_batch_padding(counts, attn_tp, expected):
    seen = []
    patched = dp_attention.make_forward_batch_padding(
        lambda self, runner: seen.append((list(self.global_num_tokens_cpu), runner)),
        attn_tp_size_fn=lambda: attn_tp)
    patched(ForwardBatchBoundary(counts), "runner")
    assert seen == [(expected, "runner")]


def test_forward_batch_without_mlp_sync_is_untouched():
    seen = []
    patched = dp_attention.make_forward_batch_padding(
        lambda self, runner: seen.append(self.global_num_tokens_cpu), attn_tp_size_fn=lambda: 4)
    patched(ForwardBatchBoundary(None), None)
    assert seen == [None]


class DpPaddingModeBoundary(enum.IntEnum):
    """Stands in for sglang.srt.layers.dp_attention.DpPaddingMode (an IntEnum)."""
    MAX_LEN = enum.auto()
    SUM_LEN = enum.auto()

    @classmethod
    def get_dp_padding_mode(cls, is_extend_in_batch, global_num_tokens):
        return cls.SUM_LEN if is_extend_in_batch else cls.MAX_LEN


def _retarget(patch_name: str, module_name: str):
    patch = next(p for p in all_patches() if p.name == patch_name)
    return dataclasses.replace(patch, target=dataclasses.replace(patch.target, module=module_name))


def test_dp_padding_mode_applied_through_registry(monkeypatch):
    mod = types.ModuleType("dsv41_boundary_dp_attention")
    mode_cls = enum.IntEnum("DpPaddingMode", "MAX_LEN SUM_LEN")
    mode_cls.get_dp_padding_mode = DpPaddingModeBoundary.__dict__["get_dp_padding_mode"]
    mod.DpPaddingMode = mode_cls
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    patch = _retarget("prefill_padding.dp_padding_mode", mod.__name__)
    statuses = apply_patches("scheduler", patches=[patch])
    assert [s.state for s in statuses] == ["applied"]
    assert mode_cls.get_dp_padding_mode(True, [6, 0]) == mode_cls.MAX_LEN  # idle rank
    assert mode_cls.get_dp_padding_mode(True, [6, 2]) == mode_cls.SUM_LEN  # upstream choice
    assert apply_patches("scheduler", patches=[patch])[0].detail == "already"
    assert apply_patches("scheduler", patches=[patch], disabled=["prefill_padding"]
                         )[0].state == "off"


def test_live_signature_change_is_refused(monkeypatch):
    mod = types.ModuleType("dsv41_boundary_changed")
    mod.DpPaddingMode = type("DpPaddingMode", (), {
        "get_dp_padding_mode": classmethod(lambda cls, is_extend_in_batch, counts, extra: 0)})
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with pytest.raises(PatchTargetError, match="prefill_padding.dp_padding_mode.*parameters"):
        apply_patches("scheduler", patches=[_retarget("prefill_padding.dp_padding_mode",
                                                      mod.__name__)])
    empty = types.ModuleType("dsv41_boundary_empty")
    monkeypatch.setitem(sys.modules, empty.__name__, empty)
    with pytest.raises(PatchTargetError, match="DpPaddingMode.get_dp_padding_mode is missing"):
        apply_patches("scheduler", patches=[_retarget("prefill_padding.dp_padding_mode",
                                                      empty.__name__)])


# ---- idle-batch guarantee -------------------------------------------------------------------
class MLPSyncInfoBoundary:
    """Stands in for MLPSyncBatchInfo: all_gather fills global_num_tokens."""

    def __init__(self, gathered):
        self.gathered, self.global_num_tokens = gathered, None

    def all_gather(self, device, group):
        self.global_num_tokens = list(self.gathered)


def _raw_sync(gathered, returned):
    """An upstream-shaped prepare_mlp_sync_batch_raw that gathers, then returns ``returned``."""
    record = dp_attention.make_sync_recorder(MLPSyncInfoBoundary.all_gather)

    def raw(local_batch, **kw):
        record(MLPSyncInfoBoundary(gathered), "cpu", None)
        return returned

    return raw


def _call(raw, local_batch=None):
    made, updated = [], []
    guarantee = dp_attention.make_idle_batch_guarantee(
        raw, update_gather_batch_fn=lambda: lambda b, info, req, skip: updated.append(
            (b, info.global_num_tokens, req, skip)))
    out = guarantee(local_batch, 2, 4, 1, None, lambda: made.append("idle") or "IDLE",
                    True, True, True, set())
    return out, made, updated


def test_idle_batch_created_when_another_rank_has_tokens():
    out, made, updated = _call(_raw_sync([0, 7], None))
    assert out == "IDLE" and made == ["idle"]
    assert updated == [("IDLE", [0, 7], True, False)]
    assert STATE.last_sync is None


def test_no_idle_batch_when_nobody_has_tokens_or_rank_has_a_batch():
    assert _call(_raw_sync([0, 0], None))[:2] == (None, [])
    assert _call(_raw_sync([3, 7], "LOCAL"), "LOCAL")[:2] == ("LOCAL", [])


# ---- stall watchdog and the health check ----------------------------------------------------
class SchedulerBoundary:
    """Stands in for sglang Scheduler: run_batch blocks like a forward stuck in a collective."""

    def __init__(self, block_s):
        self.block_s = block_s

    def run_batch(self, batch, pp_proxy_tensors=None):
        time.sleep(self.block_s)
        return batch


def test_stall_reported_to_health_check(tmp_path):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()

    @app.get("/health_generate")
    async def health_generate():
        return {"ok": True}

    watchdog.install_health_middleware(types.SimpleNamespace(app=app), "health_generate",
                                       health_generate, run_dir=str(tmp_path))
    client = TestClient(app)
    assert client.get("/health_generate").status_code == 200

    STATE.start_watchdog(tp_rank=3, timeout_s=0.2, run_dir=str(tmp_path))
    STATE.step = 11
    run_batch = watchdog.make_guarded_run_batch(SchedulerBoundary.run_batch)
    worker = threading.Thread(target=run_batch, args=(SchedulerBoundary(1.5), "batch"))
    worker.start()
    try:
        deadline = time.monotonic() + 1.2
        while not read_stall_reports(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        [report] = read_stall_reports(str(tmp_path))
        assert (report["rank"], report["step"], report["op"]) == (3, 11, "run_batch")
        resp = client.get("/health_generate")
        assert resp.status_code == 503
        message = resp.json()["error"]["message"]
        assert "rank 3" in message and "step 11" in message and "run_batch" in message
    finally:
        worker.join()
    # the forward finished after all: not a deadlock, the rank is healthy again
    assert read_stall_reports(str(tmp_path)) == []
    assert client.get("/health_generate").status_code == 200


def test_mlp_sync_opens_steps_and_fast_ones_raise_no_stall(tmp_path):
    STATE.start_watchdog(tp_rank=0, timeout_s=0.5, run_dir=str(tmp_path))
    guarded = watchdog.make_guarded_mlp_sync(lambda self, b: b)
    for i in range(20):
        assert guarded(None, i) == i
    time.sleep(0.1)
    assert read_stall_reports(str(tmp_path)) == [] and STATE.step == 20


def test_recovered_mlp_sync_stall_is_cleared(tmp_path):
    STATE.start_watchdog(tp_rank=1, timeout_s=0.1, run_dir=str(tmp_path))
    seen = []

    def slow_sync(self, batch):
        time.sleep(0.5)
        seen.extend(read_stall_reports(str(tmp_path)))
        return batch

    assert watchdog.make_guarded_mlp_sync(slow_sync)(None, "b") == "b"
    assert [(r["rank"], r["step"], r["op"]) for r in seen] == [(1, 1, "mlp_sync")]
    assert read_stall_reports(str(tmp_path)) == []


# ---- DP-rank pinning ------------------------------------------------------------------------
def test_resolve_routed_dp_rank():
    r = dp_routing.resolve_routed_dp_rank
    assert r(None, None, None, 4) is None
    assert r(2, None, None, 4) == 2
    assert r(None, 3, None, 4) == 3          # deprecated alias
    assert r(None, None, " 1 ", 4) == 1      # header
    assert r(1, 1, "1", 4) == 1
    assert r(0, None, None, 1) == 0
    for args, msg in [((4, None, None, 4), "out of range"), ((-1, None, None, 4), "out of range"),
                      ((1, 2, None, 4), "conflicting"), ((1, None, "2", 4), "conflicting"),
                      ((None, None, "x", 4), "header must be an integer"),
                      ((True, None, None, 4), "must be an integer"),
                      (("1", None, None, 4), "must be an integer")]:
        with pytest.raises(ValueError, match=msg):
            r(*args)


class TokenizerManagerBoundary:
    """Stands in for TokenizerManager: server_args.dp_size and an async generate_request."""

    server_args = types.SimpleNamespace(dp_size=2)

    async def generate_request(self, obj, request=None):
        yield {"routed_dp_rank": obj.routed_dp_rank}


class RequestBoundary:
    """Stands in for the fastapi Request: only headers are read."""

    def __init__(self, headers):
        self.headers = {k.lower(): v for k, v in headers.items()}


def _generate(obj, headers=None):
    patched = dp_routing.make_pin_validation(TokenizerManagerBoundary.generate_request)
    request = RequestBoundary(headers) if headers is not None else None

    async def first():
        return await patched(TokenizerManagerBoundary(), obj, request).__anext__()

    return asyncio.run(first())


def test_pin_validation_in_generate_request():
    req = lambda **kw: types.SimpleNamespace(**{"routed_dp_rank": None,  # noqa: E731
                                                "data_parallel_rank": None, **kw})
    assert _generate(req(), {"X-Data-Parallel-Rank": "1"}) == {"routed_dp_rank": 1}
    assert _generate(req(data_parallel_rank=1)) == {"routed_dp_rank": 1}
    assert _generate(req()) == {"routed_dp_rank": None}
    with pytest.raises(ValueError, match=r"out of range \[0, 2\)"):
        _generate(req(routed_dp_rank=2))
    with pytest.raises(ValueError, match="conflicting"):
        _generate(req(routed_dp_rank=0), {"X-Data-Parallel-Rank": "1"})
    embedding = types.SimpleNamespace()  # EmbeddingReqInput has no pin fields
    patched = dp_routing.make_pin_validation(
        lambda self, obj, request: _agen({"embedding": True}))
    assert asyncio.run(patched(TokenizerManagerBoundary(), embedding).__anext__()) == {
        "embedding": True}


async def _agen(value):
    yield value


class ControllerBoundary:
    """Stands in for DataParallelController: workers are the per-rank sockets."""

    def __init__(self, n):
        self.workers = [[] for _ in range(n)]


def test_dispatch_guard_never_indexes_with_a_bad_rank():
    def upstream(self, req):  # as SGLang 0.5.10.post1
        if req.routed_dp_rank is not None:
            self.workers[req.routed_dp_rank].append(req.rid)
            return True
        return False

    guard = dp_routing.make_dispatch_guard(upstream)
    ctl = ControllerBoundary(2)
    for rid, rank in [("a", 1), ("b", -1), ("c", 2)]:
        assert guard(ctl, types.SimpleNamespace(rid=rid, routed_dp_rank=rank)) is True
    assert ctl.workers == [[], ["a"]]
    assert guard(ctl, types.SimpleNamespace(rid="d", routed_dp_rank=None)) is False
