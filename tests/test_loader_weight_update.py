"""Weight updates on the real model at the library level: dummy load + update == full load,
refusals by name (Engram tables included), the control-op handlers, SGLang's dummy reseeding,
bucket packing of the distributed update."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from engine_core_harness import engine_test_model, write_flat_checkpoint
from sglang_dsv41.loader.dummy import is_engram_table
from sglang_dsv41.loader.serving import load_serving_model
from sglang_dsv41.loader.weight_sync_group import send_weights
from sglang_dsv41.loader.weight_update import (WeightUpdateError, engram_checksums,
                                               validate_named_tensors)
from sglang_dsv41.engine.weight_update_ops import LOADER_CONTROL_OPS
from sglang_dsv41.model.dsv4.context import DSV4Context

TABLE = "layers.1.engram.embed.weight"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg, model = engine_test_model()
    path = write_flat_checkpoint(str(tmp_path_factory.mktemp("wu")), cfg, model)
    return path, model.state_dict()


def full_update(tensors):
    """A trainer's full state dict without Engram tables."""
    return [(n, t.clone()) for n, t in tensors.items() if not is_engram_table(n)]


def logits(model):
    ids = torch.tensor([(5 * i + 2) % 256 for i in range(40)])
    with torch.no_grad():
        return model(ids, DSV4Context.packed([40]))


class FakeRunner:
    def __init__(self, model, path):
        self.model, self.model_dir, self.weight_version, self.flushes = model, path, "default", 0
        self.args = SimpleNamespace(allow_engram_update=False, tp_size=1)

    def flush_cache_hook(self):
        self.flushes += 1
        return True


def run_op(runner, op, **args):
    apply, validate = LOADER_CONTROL_OPS[op]
    if validate is not None:
        validate(runner, **args)
    return apply(runner, **args)


def test_dummy_load_then_update_equals_full_load(ckpt):
    path, tensors = ckpt
    full = load_serving_model(path, torch.float32, "cpu")
    dummy = load_serving_model(path, torch.float32, "cpu", "dummy")
    assert not torch.equal(logits(full), logits(dummy))
    assert engram_checksums(dummy) == engram_checksums(full)   # dummy keeps the tables
    run_op(FakeRunner(dummy, path), "update_weights_from_tensor",
           named_tensors=full_update(tensors))
    assert torch.equal(logits(full), logits(dummy))


def test_bad_updates_are_refused_by_name(ckpt):
    path, tensors = ckpt
    model = load_serving_model(path, torch.float32, "cpu")
    head = tensors["head.weight"]
    tid2eid = next(n for n in tensors if n.endswith("tid2eid"))
    past = tensors[tid2eid].clone()
    past[5, 0] = model.cfg.n_routed_experts  # one id past the experts: the next forward crashed
    cases = [
        ([(tid2eid, past)], f"{tid2eid}: expert ids 0..{model.cfg.n_routed_experts} outside"),
        ([("nope.weight", head)], "nope.weight: the served model has no tensor"),
        ([("head.weight", head[:3])], "head.weight: shape"),
        ([("head.weight", head.double())], "head.weight: dtype float64"),
        ([("head.weight", head), ("head.weight", head)], "given twice"),
        ([("head.weight", head * float("nan"))], "NaN or inf"),
        ([(TABLE, tensors[TABLE])], f"{TABLE}: refusing to overwrite a frozen Engram table"),
        ([("x",)], "entry 0 is not a"),
    ]
    for named, message in cases:
        with pytest.raises(WeightUpdateError, match=message.replace("(", r"\(")):
            validate_named_tensors(model, named)
    validate_named_tensors(model, [(TABLE, tensors[TABLE])], allow_engram=True)


def test_forced_engram_update_changes_the_checksum(ckpt):
    path, tensors = ckpt
    model = load_serving_model(path, torch.float32, "cpu")
    runner, before = FakeRunner(model, path), engram_checksums(model)
    zeros = torch.zeros_like(tensors[TABLE])
    with pytest.raises(WeightUpdateError, match="frozen Engram"):
        run_op(runner, "update_weights_from_tensor", named_tensors=[(TABLE, zeros)])
    run_op(runner, "update_weights_from_tensor", named_tensors=[(TABLE, zeros)],
           allow_engram_update=True)
    after = engram_checksums(model)
    assert after[TABLE] != before[TABLE]
    assert {k: v for k, v in after.items() if k != TABLE} == \
        {k: v for k, v in before.items() if k != TABLE}


def test_control_ops_bump_version_and_flush(ckpt, tmp_path):
    path, tensors = ckpt
    runner = FakeRunner(load_serving_model(path, torch.float32, "cpu", "dummy"), path)
    out = run_op(runner, "update_weights_from_tensor", named_tensors=full_update(tensors))
    assert out["weight_version"] == "1" and runner.flushes == 1
    out = run_op(runner, "update_weights_from_tensor", named_tensors=full_update(tensors)[:3],
                 flush_cache=False, weight_version="step-7")
    assert out["weight_version"] == "step-7" and runner.flushes == 1
    assert set(run_op(runner, "engram_checksum")) == {
        f"layers.{i}.engram.embed.{p}" for i in (1, 5) for p in ("weight", "scale")}
    out = run_op(runner, "update_weights_from_disk", model_path=path)
    assert out["num_tensors"] == len(full_update(tensors)) and runner.flushes == 2
    assert out["weight_version"] == "step-8"
    with pytest.raises(WeightUpdateError, match="cannot read checkpoint"):
        run_op(runner, "update_weights_from_disk", model_path=str(tmp_path / "nowhere"))
    partial = tmp_path / "partial"
    partial.mkdir()
    runner.model.cfg.save_pretrained(str(partial))
    save_file({"head.weight": tensors["head.weight"]}, os.path.join(partial, "m.safetensors"))
    with pytest.raises(WeightUpdateError, match="missing from checkpoint"):
        run_op(runner, "update_weights_from_disk", model_path=str(partial))
    assert runner.weight_version == "step-8"


def test_dummy_init_matches_sglang_per_tensor_reseeding(ckpt):
    from sglang_dsv41.loader.dummy import dummy_init_

    _, model = engine_test_model()
    table = model.get_buffer(TABLE).clone()
    filled = dummy_init_(model, seed=1234)
    assert TABLE not in filled and torch.equal(model.get_buffer(TABLE).view(torch.uint8),
                                               table.view(torch.uint8))
    for name, t in model.state_dict().items():
        if name in filled:  # initialize_dummy_weights: a fresh generator per tensor
            want = torch.empty_like(t).uniform_(
                -1e-3, 1e-3, generator=torch.Generator().manual_seed(1234))
            assert torch.equal(t, want), name


class LoopbackGroup:
    """Stands in for both ends of a WeightSyncGroup in one process: what the sender
    broadcasts, the receiver gets, in order."""

    def __init__(self):
        self.sent, self.device = [], torch.device("cpu")

    def all_ok(self, ok):
        return ok

    def broadcast_(self, t, src=0):
        self.sent.append(t.clone())


def test_bucket_packing_round_trips_mixed_dtypes():
    from sglang_dsv41.loader.weight_sync_group import receive_weights

    named = [("a", torch.randn(3, dtype=torch.float32).to(torch.bfloat16)),  # 6 bytes: unaligned
             ("b", torch.randn(5, 7)), ("c", torch.arange(9, dtype=torch.int64)),
             ("d", torch.randn(2, 2).to(torch.float8_e4m3fn))]
    link = LoopbackGroup()
    assert send_weights(link, named, bucket_bytes=64)
    sent = iter(link.sent)
    receiver = LoopbackGroup()
    receiver.broadcast_ = lambda t, src=0: t.copy_(next(sent))
    got = receive_weights(receiver, [n for n, _ in named], [t.dtype for _, t in named],
                          [list(t.shape) for _, t in named], ok=True)
    assert [n for n, _ in got] == ["a", "b", "c", "d"]
    for (_, want), (_, t) in zip(named, got):
        assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8), want.view(torch.uint8))


def test_send_weights_casts_a_bucket_at_a_time_to_the_wire_dtypes():
    """The trainer's fp32 weights go out as the served dtype: send_weights casts inside each
    bucket (no cast copy of the whole model first), strided views included, and the receiver,
    planning with the wire dtypes, gets exactly the casts."""
    from sglang_dsv41.loader.weight_sync_group import receive_weights

    stacked = torch.randn(4, 6, 5)
    named = [("w", torch.randn(7, 3)), ("experts.1", stacked[1]), ("t", torch.randn(5, 6).t()),
             ("sink", torch.randn(4))]
    wire = [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32]
    link = LoopbackGroup()
    assert send_weights(link, named, bucket_bytes=64, dtypes=wire)
    assert len(link.sent) > 3  # bucket size, then several buckets of <= 64 bytes each
    sent = iter(link.sent)
    receiver = LoopbackGroup()
    receiver.broadcast_ = lambda t, src=0: t.copy_(next(sent))
    got = receive_weights(receiver, [n for n, _ in named], wire,
                          [list(t.shape) for _, t in named], ok=True)
    for (name, want), dtype, (got_name, t) in zip(named, wire, got):
        assert got_name == name and t.dtype == dtype
        assert torch.equal(t, want.to(dtype)), name


def test_a_distributed_update_with_an_unknown_dtype_is_refused_to_the_trainer_at_once():
    """An unknown dtype name is a refusal the trainer hears in the protocol's verdict exchange
    (send_weights returns False); the server raised before joining it, and the trainer waited in
    a real gloo group until the collective's timeout."""
    import threading
    import time
    import types

    from sglang_dsv41.engine.weight_update_ops import _apply_distributed
    from sglang_dsv41.loader.weight_sync_group import init_weight_sync_group
    from sglang_dsv41.ports import free_port

    port, res = free_port(), {}

    def trainer():
        group = init_weight_sync_group("127.0.0.1", port, 0, 2, "wg", "gloo", timeout_s=20)
        t0 = time.monotonic()
        res["sent"] = send_weights(group, [("weight", torch.zeros(1, 2))],
                                   dtypes=[torch.float32])
        res["waited_s"] = time.monotonic() - t0
        group.close()

    thread = threading.Thread(target=trainer)
    thread.start()
    group = init_weight_sync_group("127.0.0.1", port, 1, 2, "wg", "gloo", timeout_s=20)
    runner = types.SimpleNamespace(
        weight_sync_groups={"wg": group}, model=torch.nn.Linear(2, 1),
        args=types.SimpleNamespace(allow_engram_update=False),
        groups=types.SimpleNamespace(all_agree=lambda ok, op: ok))
    with pytest.raises(WeightUpdateError, match="unknown dtype 'complex64'"):
        _apply_distributed(runner, ["weight"], ["complex64"], [[1, 2]], group_name="wg")
    thread.join(30)
    group.close()
    assert res["sent"] is False and res["waited_s"] < 10, res
