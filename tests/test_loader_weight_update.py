"""Weight updates at the library level: validation, dummy load + update == full load, Engram
protection and checksums, the control-op handlers, and a distributed update from a real
trainer process over a second process group (gloo)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from loader_fixtures import collect, free_port, kill_all, start_world, tiny_cfg, write_checkpoint

from sglang_dsv41.loader.checkpoint import load_model, save_checkpoint
from sglang_dsv41.loader.serving import load_serving_model
from sglang_dsv41.loader.weight_sync_group import init_weight_sync_group, send_weights
from sglang_dsv41.loader.weight_update import (WeightUpdateError, apply_named_tensors,
                                               engram_checksums, validate_named_tensors)
from sglang_dsv41.loader.weight_update_ops import LOADER_CONTROL_OPS
from sglang_dsv41.model.model import is_engram_table, reference_logprobs
from sglang_dsv41.server_args import ServerArgs

TABLE = "model.layers.1.engram.table.weight"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("wu") / "ckpt")
    tensors = write_checkpoint(path, tiny_cfg(), "bf16")
    return path, tensors


@pytest.fixture(autouse=True)
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DSV41_SHM_DIR", str(tmp_path))


def full_update(tensors, dtype=torch.float32):
    """A trainer's full state dict without Engram, in the served dtype."""
    return [(n, t.to(dtype)) for n, t in tensors.items() if not is_engram_table(n)]


def logprobs(model):
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    return torch.cat(reference_logprobs(model, seqs)[0])


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("wu8") / "ckpt")
    return path, write_checkpoint(path, tiny_cfg(), "fp8")


@pytest.mark.parametrize("layout,table", [("shared", "bf16"), ("private", "fp8")])
def test_dummy_load_then_update_equals_full_load(ckpt, fp8_ckpt, layout, table):
    path, tensors = ckpt if table == "bf16" else fp8_ckpt
    full, full_handle = load_serving_model(path, torch.float32, "cpu", "auto", layout)
    dummy, handle = load_serving_model(path, torch.float32, "cpu", "dummy", layout)
    want = logprobs(full)
    if table == "bf16":  # host tables are invisible: the same as the plain parameter model
        assert torch.equal(want, logprobs(load_model(path, torch.float32)))
    assert not torch.equal(logprobs(dummy), want)
    assert all(float(p.detach().abs().max()) <= 1e-3 for p in dummy.parameters())  # SGLang's dummy
    before = engram_checksums(dummy)
    update = full_update(tensors)
    validate_named_tensors(dummy, update)
    apply_named_tensors(dummy, update)
    assert torch.equal(logprobs(dummy), want)
    assert engram_checksums(dummy) == before == engram_checksums(full)
    handle.close()
    full_handle.close()


def test_bad_updates_are_refused_by_name(ckpt):
    path, tensors = ckpt
    model, handle = load_serving_model(path, torch.float32, "cpu", "auto", "private")
    name = "model.layers.0.self_attn.q_proj.weight"
    good = dict(full_update(tensors))[name]
    cases = {
        "model.layers.0.self_attn.nope.weight": [("model.layers.0.self_attn.nope.weight", good)],
        "shape": [(name, good[:-1])],
        "dtype": [(name, good.to(torch.bfloat16))],
        "frozen Engram": [(TABLE, torch.zeros(4096, 32, dtype=torch.bfloat16))],
        "twice": [(name, good), (name, good)],
        "NaN": [(name, torch.full_like(good, float("nan")))],
    }
    for needle, named in cases.items():
        with pytest.raises(WeightUpdateError, match=needle) as err:
            validate_named_tensors(model, named)
        assert named[0][0] in str(err.value)
    handle.close()


@pytest.mark.parametrize("layout", ["shared", "private"])
def test_forced_engram_update_changes_the_checksum(ckpt, layout):
    path, tensors = ckpt
    model, handle = load_serving_model(path, torch.float32, "cpu", "auto", layout)
    before = engram_checksums(model)
    new = torch.randn(4096, 32).to(torch.bfloat16)
    validate_named_tensors(model, [(TABLE, new)], allow_engram=True)
    apply_named_tensors(model, [(TABLE, new)])
    rows = torch.tensor([0, 5, 4095])
    assert torch.equal(model.model.layers[1].engram.table.lookup(rows), new[rows].float())
    assert engram_checksums(model)[TABLE] != before[TABLE]
    handle.close()


class FakeRunner:
    """The attributes of the engine's ModelRunner that the loader's control ops use."""

    def __init__(self, model, rank=0, tp_size=1, allow_engram=False):
        self.model, self.info = model, SimpleNamespace(rank=rank)
        self.args = ServerArgs(tp_size=tp_size, allow_engram_update=allow_engram)
        self.weight_version, self.flushes = "default", 0
        self.groups = SimpleNamespace(all_agree=self._all_agree)
        self.flush_cache_hook = self._flush

    def _flush(self):
        self.flushes += 1
        return True

    @staticmethod
    def _all_agree(ok, op):
        if not dist.is_initialized():
            return ok
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, bool(ok))
        return all(out)


def run_op(runner, op, **args):
    apply, validate = LOADER_CONTROL_OPS[op]
    if validate is not None:
        validate(runner, **args)
    return apply(runner, **args)


def test_control_ops_bump_version_and_flush(ckpt, tmp_path):
    path, tensors = ckpt
    model, handle = load_serving_model(path, torch.float32, "cpu", "dummy", "shared")
    runner = FakeRunner(model)
    out = run_op(runner, "update_weights_from_tensor", named_tensors=full_update(tensors))
    assert out["weight_version"] == "1" and runner.flushes == 1
    out = run_op(runner, "update_weights_from_tensor", named_tensors=full_update(tensors)[:3],
                 flush_cache=False, weight_version="step-7")
    assert out["weight_version"] == "step-7" and runner.flushes == 1
    assert set(run_op(runner, "engram_checksum")) == {TABLE}
    out = run_op(runner, "update_weights_from_disk", model_path=path)
    assert out["num_tensors"] == len(full_update(tensors)) and runner.flushes == 2
    assert out["weight_version"] == "step-8"
    with pytest.raises(WeightUpdateError, match="cannot read checkpoint"):
        run_op(runner, "update_weights_from_disk", model_path=str(tmp_path / "nowhere"))
    partial = save_checkpoint(dict(list(tensors.items())[:3]), str(tmp_path / "partial"),
                              tiny_cfg(), tokenizer=False)
    with pytest.raises(WeightUpdateError, match="missing from checkpoint"):
        run_op(runner, "update_weights_from_disk", model_path=partial)
    assert runner.weight_version == "step-8"
    handle.close()


def _scheduler_rank(rank, world, path, port, updates):
    model, handle = load_serving_model(path, torch.float32, "cpu", "dummy", "private", rank,
                                       world, namespace="dist_update")
    runner = FakeRunner(model, rank, world)
    run_op(runner, "init_weights_update_group", master_address="127.0.0.1", master_port=port,
           rank_offset=1, world_size=world + 1, group_name="g", backend="gloo")
    outcomes = []
    for names, dtypes, shapes in updates:
        try:
            out = run_op(runner, "update_weights_from_distributed", names=names, dtypes=dtypes,
                         shapes=shapes, group_name="g")
            outcomes.append(("ok", out["weight_version"]))
        except WeightUpdateError as e:
            outcomes.append(("refused", str(e)))
        outcomes.append(logprobs(model))
    checksums = run_op(runner, "engram_checksum")
    run_op(runner, "destroy_weights_update_group", group_name="g")
    handle.close()
    return outcomes, checksums


def test_distributed_update_from_a_trainer_process(ckpt):
    path, tensors = ckpt
    named = full_update(tensors)
    meta = lambda items: ([n for n, _ in items], [str(t.dtype) for _, t in items],  # noqa: E731
                          [list(t.shape) for _, t in items])
    bad = [(n, t[:1] if i == 2 else t) for i, (n, t) in enumerate(named)]  # one wrong shape
    port = free_port()
    procs, queue = start_world(_scheduler_rank, 2, (path, port, [meta(named), meta(bad)]))
    try:
        group = init_weight_sync_group("127.0.0.1", port, 0, 3, "g", "gloo", timeout_s=60)
        assert send_weights(group, named, bucket_bytes=1 << 16)  # several buckets
        assert not send_weights(group, bad)
        results = collect(procs, queue, timeout=60)
    finally:
        kill_all(procs)
    full, handle = load_serving_model(path, torch.float32, "cpu", "auto", "shared")
    want = logprobs(full)
    handle.close()
    for outcomes, checksums in results:
        assert outcomes[0] == ("ok", "1") and torch.equal(outcomes[1], want)
        assert outcomes[2][0] == "refused" and bad[2][0] in outcomes[2][1]
        assert torch.equal(outcomes[3], want)  # the refused update changed nothing
        assert checksums == results[0][1]
    group.close()


def test_dummy_init_matches_sglang_per_tensor_reseeding():
    from sglang_dsv41.loader.dummy import dummy_init_
    from sglang_dsv41.model import build_model

    model = build_model(tiny_cfg(), torch.bfloat16)
    table = model.model.layers[1].engram.table.weight.detach().clone()
    filled = dummy_init_(model, seed=1234)
    assert TABLE not in filled and torch.equal(model.get_parameter(TABLE), table)
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
