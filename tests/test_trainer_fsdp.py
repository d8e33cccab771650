"""FSDP2 policy on 2 gloo ranks vs the unsharded model in one process: logprobs, R3 replay, sink
gradients (reduced like every other gradient, equal on both ranks, fp32), uneven micro-batches."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from sglang_dsv41.loader.checkpoint import load_model
from sglang_dsv41.model import ForwardContext
from sglang_dsv41.server_process import free_port
from trainer_bridge.batch import Sample, pack

pytestmark = pytest.mark.timeout(180)
WORLD = 2


def rank_samples(model, rank: int) -> list[Sample]:
    """Two samples per rank with the unsharded model's own routing recorded (as the server's)."""
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for n in (9, 12):
        toks = torch.randint(0, 256, (n,), generator=gen).tolist()
        ctx = ForwardContext.packed([n], record_routing=True)
        with torch.no_grad():
            model(torch.tensor(toks), ctx)
        cfg = model.config
        ids = np.full((n - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, np.int32)
        w = np.zeros(ids.shape, np.float32)
        for layer, (i, wt) in ctx.routed.items():
            ids[:, layer], w[:, layer] = i[:-1].numpy(), wt[:-1].numpy()
        s = Sample(toks, [0] * 4 + [1] * (n - 4), [0.0] * n, 1.0, 0, routed_experts=ids,
                   routed_weights=w)
        s.advantage = 1.0 if rank == 0 else -0.5
        out.append(s)
    return out


def worker(rank: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from trainer_bridge.config import ModelConfig
    from trainer_bridge.dist import close_distributed, init_distributed
    from trainer_bridge.policy import build_policy

    try:
        info = init_distributed(torch.device("cpu"))
        policy = build_policy(ModelConfig(model_path="tiny"), info.mesh, torch.device("cpu"))
        samples = rank_samples(load_model("tiny", dtype=torch.float32), rank)
        # Rank 0 runs both samples in one micro-batch; rank 1 one per micro-batch.
        mbs = ([pack(samples, policy.moe_layers, True), pack([], policy.moe_layers, True, 2)]
               if rank == 0 else [pack([s], policy.moe_layers, True) for s in samples])
        logps, routed_ok = [], True
        for mb in mbs:
            out = policy.forward(mb, replay=True, record_routing=True)
            if mb.routing:
                for layer, (ids, w) in mb.routing.items():
                    routed_ok &= torch.equal(out.routed[layer][0].cpu(), ids)
                    routed_ok &= torch.equal(out.routed[layer][1].cpu(), w)
            (-(out.logprobs * mb.advantages * mb.loss_mask).sum()).backward()
            logps.append(out.logprobs.detach().numpy())
        sinks = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).numpy()
                 for n, p in policy.model.named_parameters() if n.endswith("sinks")}
        dtypes = {n: (str(p.dtype), str(p.grad.dtype)) for n, p in policy.model.named_parameters()
                  if n.endswith("sinks")}
        queue.put((rank, logps, routed_ok, sinks, dtypes))
        close_distributed()
    except Exception as e:  # report instead of hanging the parent
        import traceback

        queue.put((rank, "error", traceback.format_exc(), str(e), None))


def collect(queue, procs, count: int, timeout: float) -> list:
    """Results from the workers; fails fast when one dies without answering."""
    import queue as queue_mod
    import time

    out, deadline = [], time.monotonic() + timeout
    while len(out) < count:
        try:
            out.append(queue.get(timeout=1.0))
        except queue_mod.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"workers died (exit codes {dead}) or timed out") from None
    return out


def test_fsdp_policy_matches_unsharded_model():
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = sorted(collect(queue, procs, WORLD, timeout=150), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for r in results:
        assert r[1] != "error", r[2]

    model = load_model("tiny", dtype=torch.float32)
    total = 0
    for rank, logps, routed_ok, _, _ in results:
        assert routed_ok, f"rank {rank}: replayed routing differs from the recorded one"
        samples = rank_samples(model, rank)
        mb = pack(samples, [], False)
        hidden = model(mb.input_ids, ForwardContext.packed(mb.seq_lens))
        ref = model.token_logprobs(hidden[mb.hidden_index], mb.targets)
        got = logps[0] if rank == 0 else np.concatenate(logps)  # rank 0: samples + a dummy
        assert np.abs(ref.detach().numpy() - got).max() < 1e-5
        total = total - (ref * mb.advantages * mb.loss_mask).sum()
    (total / WORLD).backward()  # FSDP averages gradients over ranks
    sinks0, sinks1 = results[0][3], results[1][3]
    assert len(sinks0) == model.config.num_hidden_layers
    for name, g in sinks0.items():
        assert np.array_equal(g, sinks1[name]), f"{name}: sink gradients differ across ranks"
        ref = model.get_parameter(name.replace(".sink_holder.sinks", ".sinks")).grad.numpy()
        assert np.abs(g - ref).max() < 1e-5 and np.abs(g).max() > 0
        assert results[0][4][name] == ("torch.float32", "torch.float32")
