"""What a long sequence needs from the trainer: mHC's backward keeps no fp32 copy of the streams,
checkpointed layers recompute without calling the fp32 holders through FSDP again (on CUDA with
torch 2.11 that call failed in FSDP2's root pre-forward), and a bad checkpointing policy is
refused by name."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sglang_dsv41.model.dsv4.mhc import hc_mix, unweighted_rms_norm, weighted_stream_sum
from sglang_dsv41.ports import free_port
from trainer_bridge.batch import Sample, pack
from trainer_bridge.dist import run_spawned

POLICIES = ("none", "layer", "selective")


def plain_mix(streams, fn, eps):
    return F.linear(unweighted_rms_norm(streams.flatten(1).float(), eps), fn.float())


def plain_stream_sum(streams, pre):
    acc = pre[:, 0:1].float() * streams[:, 0].float()
    for k in range(1, streams.shape[1]):
        acc = acc + pre[:, k:k + 1].float() * streams[:, k].float()
    return acc.to(streams.dtype)


def saved_fp32_stream_copies(mix, stream_sum, streams, fn, pre) -> tuple[float, list]:
    """How many fp32 copies of the streams (in elements, apart from the streams themselves)
    one sublayer's mHC keeps for its backward, and its gradients."""
    s, w, p = (t.detach().clone().requires_grad_() for t in (streams, fn, pre))
    per_token = streams[0, 0].numel()  # ignore the [T, n] weights, count [T, >= D] tensors
    copied = 0

    def pack_hook(t):
        nonlocal copied
        if (t.dtype == torch.float32 and t.numel() >= streams.shape[0] * per_token
                and t.untyped_storage().data_ptr() not in inputs):
            copied += t.numel()
        return t

    inputs = {s.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        mixed, summed = mix(s, w, 1e-6), stream_sum(s, p)
    (mixed.sin().sum() + summed.float().cos().sum()).backward()
    return copied / streams.numel(), [s.grad, w.grad, p.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mhc_backward_keeps_no_fp32_stream_copy(dtype):
    gen = torch.Generator().manual_seed(0)
    streams = torch.randn(37, 4, 64, generator=gen).to(dtype)
    fn = torch.randn(24, 256, generator=gen) * 0.1
    pre = torch.rand(37, 4, generator=gen)
    ours, grads = saved_fp32_stream_copies(hc_mix, weighted_stream_sum, streams, fn, pre)
    plain, want = saved_fp32_stream_copies(plain_mix, plain_stream_sum, streams, fn, pre)
    assert ours == 0 and plain >= (1 if dtype == torch.float32 else 3), (ours, plain)
    assert torch.equal(hc_mix(streams, fn, 1e-6), plain_mix(streams, fn, 1e-6))
    assert torch.equal(weighted_stream_sum(streams, pre), plain_stream_sum(streams, pre))
    for got, ref in zip(grads, want):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def on_world_of_one(body, queue) -> None:
    """Runs body(mesh, sample) as rank 0 of a gloo world of one and puts its result (or the
    traceback, instead of hanging the parent) on the queue."""
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    from trainer_bridge.dist import close_distributed, init_distributed

    try:
        info = init_distributed(torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        toks = torch.randint(0, 256, (40,), generator=gen).tolist()
        sample = Sample(toks, [0] * 4 + [1] * 36, [0.0] * 40, 1.0, 0)
        sample.advantage = 1.0
        queue.put(body(info.mesh, sample))
        close_distributed()
    except Exception:
        import traceback

        queue.put(traceback.format_exc())


def holder_calls_and_grads(mesh, sample):
    """Per policy, the calls each fp32 holder gets in one forward + backward (FSDP2 unshards
    through them), every gradient and the number of FSDP groups the holders form."""
    from trainer_bridge.config import ModelConfig
    from trainer_bridge.parallelize import Fp32Params
    from trainer_bridge.policy import build_policy

    out = {}
    for policy_name in POLICIES:
        policy = build_policy(ModelConfig(model_path="tiny", activation_checkpointing=policy_name),
                              mesh, torch.device("cpu"))
        calls: dict[str, int] = {}
        states = set()
        for name, m in policy.model.named_modules():
            if isinstance(m, Fp32Params):
                calls[name] = 0
                states.add(id(m._get_fsdp_state()))
                m.register_forward_pre_hook(
                    lambda _m, _a, name=name: calls.__setitem__(name, calls[name] + 1))
        mb = pack([sample], policy.routed_layers, use_routing=False)
        res = policy.forward(mb, replay=False)
        (-(res.logprobs * mb.loss_mask).sum()).backward()
        grads = {n: p.grad.full_tensor().numpy().copy()
                 for n, p in policy.model.named_parameters() if p.grad is not None}
        out[policy_name] = (calls, grads, len(states))
    return out


@pytest.mark.timeout(120)
def test_checkpointed_layers_reuse_unsharded_fp32_params():
    (out,) = run_spawned(on_world_of_one, [(holder_calls_and_grads,)], timeout=110)
    assert isinstance(out, dict), out
    base_calls, base_grads, groups = out["none"]
    assert len(base_calls) > 8 and set(base_calls.values()) == {1}, base_calls
    assert groups == 1  # every layer's holders in one FSDP group
    for policy_name in ("layer", "selective"):
        calls, grads, _ = out[policy_name]
        # One call each, in the forward: the recompute hands the unsharded tensors over itself.
        assert calls == base_calls, (policy_name, calls)
        assert grads.keys() == base_grads.keys()
        for name, g in grads.items():
            want = base_grads[name]
            assert np.abs(g - want).max() <= 1e-5 * max(np.abs(want).max(), 1e-6) + 1e-7, \
                (policy_name, name)


def test_bad_activation_checkpointing_is_refused_by_name():
    from trainer_bridge.config import ModelConfig
    from trainer_bridge.parallelize import checkpoint_layer

    with pytest.raises(ValueError, match=r"activation_checkpointing='full'.*'selective'"):
        ModelConfig(model_path="tiny", activation_checkpointing="full")
    with pytest.raises(ValueError, match=r"activation checkpointing 'full': choose from"):
        checkpoint_layer(torch.nn.Linear(2, 2), "full")


def graph_freed_after_failed_backward(mesh, sample):
    """Per-layer checkpointing: a backward that fails part-way (as an out-of-memory step does)
    leaves the forward's graph; after ForwardOut.release() and a collection -> (how many of the
    forward's shared entries there were, how many are still alive)."""
    import gc
    import weakref

    from trainer_bridge.config import ModelConfig
    from trainer_bridge.policy import build_policy

    policy = build_policy(ModelConfig(model_path="tiny", activation_checkpointing="layer"),
                          mesh, torch.device("cpu"))
    mb = pack([sample], policy.routed_layers, use_routing=False)
    out = policy.forward(mb, replay=False)
    entries = [weakref.ref(t) for v in out.state.values()
               for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)]
    loss = -(out.logprobs * mb.loss_mask).sum()

    def fail(grad):
        raise RuntimeError("simulated out of memory")

    loss.register_hook(fail)
    with pytest.raises(RuntimeError, match="simulated"):
        loss.backward()
    out.release()
    del out, loss
    gc.collect()
    return len(entries), sum(r() is not None for r in entries)


@pytest.mark.timeout(120)
def test_failed_backward_frees_the_graph_after_release():
    (out,) = run_spawned(on_world_of_one, [(graph_freed_after_failed_backward,)],
                         timeout=110)
    assert isinstance(out, tuple), out
    entries, alive = out
    assert entries > 0 and alive == 0, out


def policies_reapplied(mesh, sample):
    """A policy built plain for auto checkpointing (trainer_bridge/memory_plan.py), its layers
    then given none, layer, a mix and none again in place, after FSDP2 wrapped them -> per step:
    (the layers' policies, tensors the forward saved for the backward, the gradients)."""
    from trainer_bridge.config import ModelConfig
    from trainer_bridge.memory_plan import apply
    from trainer_bridge.parallelize import layer_checkpointing
    from trainer_bridge.policy import build_policy

    policy = build_policy(ModelConfig(model_path="tiny", activation_checkpointing="auto"),
                          mesh, torch.device("cpu"))
    layers = len(policy.model.layers)
    mb = pack([sample], policy.routed_layers, use_routing=False)
    steps = []
    for mode in (None, ["layer"] * layers, ["layer", "none"] * (layers // 2), ["none"] * layers):
        if mode is not None:
            apply(policy, mode)
        saved = 0

        def count(t):
            nonlocal saved
            saved += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            res = policy.forward(mb, replay=False)
        (-(res.logprobs * mb.loss_mask).sum()).backward()
        grads = {n: p.grad.full_tensor().numpy().copy()
                 for n, p in policy.model.named_parameters() if p.grad is not None}
        policy.model.zero_grad(set_to_none=True)
        steps.append(([layer_checkpointing(layer) for layer in policy.model.layers], saved,
                      grads))
    return steps


@pytest.mark.timeout(120)
def test_checkpointing_given_again_after_fsdp_changes_what_the_forward_keeps_not_gradients():
    (out,) = run_spawned(on_world_of_one, [(policies_reapplied,)], timeout=110)
    assert isinstance(out, list), out
    (built, plain_saved, want), every, mixed, again = out
    assert set(built) == {"none"} and set(every[0]) == {"layer"} and set(again[0]) == {"none"}
    assert mixed[0][:2] == ["layer", "none"]
    # A checkpointed layer keeps its inputs only: the fewer the plain layers, the less saved.
    assert every[1] < mixed[1] < plain_saved == again[1], (every[1], mixed[1], plain_saved)
    for _, _, grads in (every, mixed, again):
        assert grads.keys() == want.keys()
        for name, g in grads.items():
            assert np.abs(g - want[name]).max() <= 1e-5 * max(np.abs(want[name]).max(), 1e-6) \
                + 1e-7, name
