"""FSDP2 policy on 2 gloo ranks vs the unsharded real tiny model (every V4.1 layer kind, Engram,
hash-routed layers) in one process: logprobs, R3 replay of ids and weights on the top-k layers,
hash layers routed from tid2eid, every gradient (sinks, mHC, compressors, indexers, experts,
Engram wkv), fp32 groups, frozen tables outside the optimizer and the weight push, uneven
micro-batches; the same with selective activation checkpointing (recomputed layers), and with
the micro-batches accumulated unsharded (FSDP's no-sync: only the last reduces)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sglang_dsv41.model.dsv4.context import DSV4Context
from sglang_dsv41.ports import free_port
from trainer_bridge.batch import Sample, pack
from trainer_bridge.dist import run_spawned

pytestmark = pytest.mark.timeout(180)
WORLD = 2
PRESET = "tiny"


def rank_samples(model, rank: int) -> list[Sample]:
    """Two samples per rank with the unsharded model's own routing recorded (as the server's)."""
    from trainer_local_sampler import recorded_routing

    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for n in (21, 30):  # past the window (16) and several compression blocks
        toks = torch.randint(0, 256, (n,), generator=gen).tolist()
        ids, w = recorded_routing(model, toks)
        s = Sample(toks, [0] * 4 + [1] * (n - 4), [0.0] * n, 1.0, 0, routed_experts=ids,
                   routed_weights=w)
        s.advantage = 1.0 if rank == 0 else -0.5
        out.append(s)
    return out


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


MODES = ("none", "selective", "none+accumulate")


def run_mode(rank: int, mode: str, info) -> tuple:
    """One policy of ``mode`` (activation checkpointing, "+accumulate": unsharded accumulation)
    on this rank: its logprobs, routing check, gradients, dtypes, trainable and optimizer
    parameters, and (rank 0) the pushed tensors' dtypes."""
    from trainer_bridge.config import ModelConfig, OptimConfig
    from trainer_bridge.policy import build_policy, load_policy_model
    from trainer_bridge.schedule import build_optimizer
    from trainer_bridge.weight_sync import full_state_dict, pushed_tensors, served_dtypes

    checkpointing, _, accumulate = mode.partition("+")
    policy = build_policy(ModelConfig(model_path=PRESET, activation_checkpointing=checkpointing,
                                      accumulate_unsharded="always" if accumulate else "never"),
                          info.mesh, torch.device("cpu"))
    assert policy.accumulate_unsharded == bool(accumulate)
    samples = rank_samples(load_policy_model(PRESET), rank)
    layers, top_k = policy.routed_layers, policy.config.num_experts_per_tok
    # Rank 0 runs both samples in one micro-batch plus a dummy; rank 1 one per micro-batch.
    mbs = ([pack(samples, layers, True, top_k), pack([], layers, True, top_k)]
           if rank == 0 else [pack([s], layers, True, top_k) for s in samples])
    logps, routed_ok = [], True
    for i, mb in enumerate(mbs):
        policy.micro_batch(i, len(mbs))  # "+accumulate": the first adds in unsharded
        out = policy.forward(mb, replay=True, record_routing=True)
        # The server routed every position but each sequence's last.
        rows = torch.ones(mb.input_ids.shape[0], dtype=torch.bool)
        rows[torch.tensor(mb.seq_lens).cumsum(0) - 1] = False
        for layer, (ids, w) in (mb.routing.items() if mb.num_samples else ()):
            # replayed on top-k layers, from tid2eid on hash layers (as the server did)
            got_ids, got_w = (t.cpu()[rows] for t in out.routed[layer])
            routed_ok &= torch.equal(got_ids.long(), ids[rows].long())
            if layer in policy.replayed_layers:
                routed_ok &= torch.equal(got_w, w[rows])
        (-(out.logprobs * mb.advantages * mb.loss_mask).sum()).backward()
        logps.append(out.logprobs.detach().numpy())
    grads = {n: full(p.grad) for n, p in policy.model.named_parameters() if p.grad is not None}
    dtypes = {n: str(p.dtype) for n, p in policy.model.named_parameters()}
    trainable = [n for n, _ in policy.trainable_parameters()]
    opt, _ = build_optimizer(policy, OptimConfig(), 4)
    in_opt = sum(len(g["params"]) for g in opt.param_groups)
    state = full_state_dict(policy.model)
    pushed = {n: (str(t.dtype), str(served_dtypes(policy.model, torch.bfloat16)[n]))
              for n, t in pushed_tensors(state)} if rank == 0 else {}
    return rank, logps, routed_ok, grads, dtypes, trainable, in_opt, pushed


def worker(rank: int, port: int, queue) -> None:
    """Every mode in one process group (one spawn for the three: the spawn and imports cost
    more than a mode's run)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    from trainer_bridge.dist import close_distributed, init_distributed

    try:
        info = init_distributed(torch.device("cpu"))
        queue.put((rank, {mode: run_mode(rank, mode, info) for mode in MODES}))
        close_distributed()
    except Exception:  # report instead of hanging the parent
        import traceback

        queue.put((rank, "error", traceback.format_exc()))


@pytest.fixture(scope="module")
def every_mode():
    port = free_port()
    out = sorted(run_spawned(worker, [(r, port) for r in range(WORLD)], timeout=170),
                 key=lambda r: r[0])
    for r in out:
        assert r[1] != "error", r[2]
    return out


@pytest.fixture(params=MODES)
def results(every_mode, request):
    return [modes[request.param] for _, modes in every_mode]


def test_fsdp_policy_matches_unsharded_model(results):
    from trainer_bridge.parallelize import server_param_name
    from trainer_bridge.policy import load_policy_model

    model = load_policy_model(PRESET)
    total = 0
    for rank, logps, routed_ok, *_ in results:
        assert routed_ok, f"rank {rank}: routing differs from the server's"
        layers = list(range(model.cfg.num_hidden_layers))
        mb = pack(rank_samples(model, rank), layers, True, model.cfg.num_experts_per_tok)
        # R3 semantics: the replayed weights are constants (no gradient through the router).
        replay = {k: v for k, v in mb.routing.items() if not model.cfg.is_hash_layer(k)}
        ctx = DSV4Context.packed(mb.seq_lens, serving_numerics=True, routing_replay=replay)
        ref = model(mb.input_ids, ctx)[mb.hidden_index].log_softmax(-1).gather(
            1, mb.targets[:, None]).squeeze(1)
        got = logps[0] if rank == 0 else np.concatenate(logps)  # rank 0: samples + a dummy
        assert np.abs(ref.detach().numpy() - got).max() < 1e-5
        total = total - (ref * mb.advantages * mb.loss_mask).sum()
    (total / WORLD).backward()  # FSDP averages gradients over ranks
    grads0, grads1 = results[0][3], results[1][3]
    assert set(grads0) == set(grads1)
    params = dict(model.named_parameters())
    # The router is frozen; every other parameter has a gradient on every rank (zero where the
    # math gives none, e.g. the indexers, which only select).
    assert {server_param_name(n) for n in grads0} == {
        n for n in params if not n.endswith("ffn.gate.weight")}
    assert sum(p.grad is not None for p in params.values()) > 0.8 * len(grads0)
    for name, g in grads0.items():
        ref = params[server_param_name(name)].grad
        want = np.zeros_like(g) if ref is None else ref.numpy()
        assert np.array_equal(g, grads1[name]), f"{name}: gradients differ across ranks"
        scale = max(np.abs(want).max(), 1e-6)
        assert np.abs(g - want).max() <= 1e-4 * scale + 1e-7, name
    assert any(".engram.wkv." in n for n in grads0)


def test_fp32_groups_frozen_tables_and_weight_push(results):
    from trainer_bridge.policy import load_policy_model

    _, _, _, _, dtypes, trainable, in_opt, pushed = results[0]
    model = load_policy_model(PRESET)
    sinks = [n for n in dtypes if n.endswith("attn_sink")]
    mhc = [n for n in dtypes if ".hc_" in n or n.startswith("fp32_params.hc_")]
    assert len(sinks) == model.cfg.num_hidden_layers and len(mhc) == 6 * len(sinks)
    assert all(dtypes[n] == "torch.float32" for n in dtypes)  # fp32 master weights everywhere
    assert not [n for n in trainable if n.endswith("ffn.gate.weight")], "router must be frozen"
    assert in_opt == len(trainable)
    # Pushed under SGLang's flat names: everything the model holds but the frozen tables.
    tables = {n for n in model.state_dict() if ".engram.embed." in n or n.endswith("tid2eid")}
    assert tables and any(n.endswith("tid2eid") for n in tables)
    assert set(pushed) == set(model.state_dict()) - tables
    assert pushed["layers.0.attn.attn_sink"] == ("torch.float32", "torch.float32")
    assert pushed["layers.3.hc_ffn_fn"][1] == "torch.float32"
    assert pushed["layers.3.ffn.experts.0.w1.weight"][1] == "torch.bfloat16"
    # FSDP2 holds each layer's routed experts as two stacks (2 parameters, not 3E); the push
    # above still names them per expert.
    layer3 = {n for n in dtypes if n.startswith("layers.3.ffn.experts.")}
    assert layer3 == {"layers.3.ffn.experts.w13", "layers.3.ffn.experts.w2"}


def router_placement(mesh, sample):
    """Per freeze_router: whether each layer's gate weight is sharded by FSDP, its dtype,
    whether it got a gradient, and the logprobs of one forward."""
    from trainer_bridge.config import ModelConfig
    from trainer_bridge.policy import build_policy

    out = {}
    for frozen in (True, False):
        policy = build_policy(ModelConfig(model_path=PRESET, freeze_router=frozen), mesh,
                              torch.device("cpu"))
        mb = pack([sample], policy.routed_layers, use_routing=False)
        res = policy.forward(mb, replay=False)
        (-(res.logprobs * mb.loss_mask).sum()).backward()
        gates = [layer.ffn.gate.weight for layer in policy.model.layers]
        out[frozen] = ([hasattr(w, "full_tensor") for w in gates], {str(w.dtype) for w in gates},
                       [w.grad is not None for w in gates], res.logprobs.detach().numpy())
    return out


def test_frozen_router_is_replicated_trained_router_sharded():
    """A frozen router (RL's default) stays out of FSDP: every rank holds it whole in fp32 and
    there is no group to gather for it each step; a trained one is its own fp32 group and gets
    a gradient. Both compute the same logprobs."""
    from test_trainer_long_context import on_world_of_one

    (out,) = run_spawned(on_world_of_one, [(router_placement,)], timeout=110)
    assert isinstance(out, dict), out
    sharded, dtypes, has_grad, frozen_logps = out[True]
    assert not any(sharded) and dtypes == {"torch.float32"} and not any(has_grad)
    sharded, dtypes, has_grad, trained_logps = out[False]
    assert all(sharded) and dtypes == {"torch.float32"} and all(has_grad)
    np.testing.assert_allclose(frozen_logps, trained_logps, rtol=0, atol=1e-6)
