"""The optimizer phase on local shards (trainer_bridge/local_shards.py) on 2 gloo ranks against
torch on whole tensors: FSDP2-sharded parameters of uneven sizes, a replicated DTensor and a
plain tensor in one set. AdamW is bitwise torch's; the norm and the clipped gradients agree to
fp32 rounding (the squares are summed in another order); the state is torch's DTensor state and
survives a distributed state-dict round trip into a fresh optimizer."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from refusals import outcome

from sglang_dsv41.ports import free_port
from trainer_bridge.dist import run_spawned

pytestmark = pytest.mark.timeout(120)
WORLD = 2
SHAPES = {"a": (7, 5), "b": (7,), "c": (3, 7), "d": (1, 4)}  # d: one row, rank 1 holds none


def build(mesh) -> torch.nn.Module:
    """A module of FSDP2-sharded parameters (a child), a replicated DTensor and a plain tensor,
    the same values on every rank."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    root, child = torch.nn.Module(), torch.nn.Module()
    for name, shape in SHAPES.items():
        child.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=gen)))
    root.sharded = fully_shard(child, mesh=mesh)
    root.rep = torch.nn.Parameter(distribute_tensor(torch.randn(6, generator=gen), mesh,
                                                    [Replicate()]))
    root.plain = torch.nn.Parameter(torch.randn(2, 2, generator=gen))
    return root


def set_grads(params, step: int, scale: float) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(10 + step)
    for p in params:
        g = torch.randn(p.shape, generator=gen) * scale
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) \
            else g


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def worker(rank: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    from trainer_bridge.local_shards import LocalShardAdamW, clip_grad_norm, global_norm

    try:
        torch.distributed.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (WORLD,))
        root = build(mesh)
        ours = list(root.parameters())
        whole = [torch.nn.Parameter(full(p)) for p in ours]
        kw = dict(lr=0.1, betas=(0.9, 0.99), weight_decay=0.05)
        opt, ref_opt = LocalShardAdamW(ours, **kw), torch.optim.AdamW(whole, **kw)
        out = {"norms": [], "adam_equal": [], "clip_err": []}
        for step in range(3):
            # step 0 unclipped (large max_norm): AdamW's arithmetic alone, compared bitwise
            max_norm = 1e9 if step == 0 else 0.5
            set_grads(ours, step, 3.0)
            set_grads(whole, step, 3.0)
            norm = clip_grad_norm(ours, max_norm)
            ref = torch.nn.utils.clip_grad_norm_(whole, max_norm)
            out["norms"].append((float(norm), float(ref)))
            out["clip_err"].append(max(float((full(p.grad) - w.grad).abs().max())
                                       for p, w in zip(ours, whole)))
            opt.step()
            ref_opt.step()
            out["adam_equal"].append(all(torch.equal(full(p), w) for p, w in zip(ours, whole)))
            out.setdefault("param_err", []).append(
                max(float((full(p) - w).abs().max()) for p, w in zip(ours, whole)))
        # torch's state layout: DTensor moments sharded like their parameters
        out["state_placements"] = all(
            isinstance(opt.state[p]["exp_avg"], DTensor) == isinstance(p, DTensor) and
            (not isinstance(p, DTensor) or opt.state[p]["exp_avg"].placements == p.placements)
            for p in ours)
        # a distributed state-dict round trip (as checkpoint.py) into a fresh optimizer
        sd = copy.deepcopy(get_optimizer_state_dict(root, opt))  # its tensors are opt's own
        root2 = build(mesh)
        again = list(root2.parameters())
        with torch.no_grad():
            for p, q in zip(again, ours):
                p.copy_(q)
        fresh = LocalShardAdamW(again, **kw)
        set_optimizer_state_dict(root2, fresh, sd)
        set_grads(ours, 9, 1.0)
        set_grads(again, 9, 1.0)
        opt.step()
        fresh.step()
        out["resumed_equal"] = all(torch.equal(full(p), full(q)) for p, q in zip(ours, again))
        # fused (CUDA's path, here on the CPU's fused kernel): clip_and_step folds the clipping
        # into AdamW's grad_scale; torch clips, then steps its own fused AdamW
        fused_root, fused_whole = build(mesh), [torch.nn.Parameter(full(p)) for p in ours]
        fused = list(fused_root.parameters())
        with torch.no_grad():
            for p, q, w in zip(fused, ours, fused_whole):
                p.copy_(q)
                w.copy_(full(q))
        fused_opt = LocalShardAdamW(fused, fused=True, **kw)
        fused_ref = torch.optim.AdamW(fused_whole, fused=True, **kw)
        out["fused"] = []
        for step in range(3):
            max_norm = 1e9 if step == 0 else 0.5
            set_grads(fused, step, 3.0)
            set_grads(fused_whole, step, 3.0)
            norm = fused_opt.clip_and_step(max_norm)
            ref = torch.nn.utils.clip_grad_norm_(fused_whole, max_norm)
            fused_ref.step()
            out["fused"].append((
                float(norm), float(ref),
                max(float((full(p.grad) - w.grad).abs().max()) for p, w in zip(fused, fused_whole)),
                max(float((full(p) - w).abs().max()) for p, w in zip(fused, fused_whole))))
        out["unfused_grad_scale"] = outcome(lambda: opt.step(grad_scale=torch.ones(())))
        # sharded-only sets: the norm of the full tensors
        shards = [p.grad for p in root.sharded.parameters()]
        want = torch.cat([full(g).flatten() for g in shards]).norm()
        out["sharded_norm"] = (float(global_norm(shards)), float(want))
        out["partial"] = outcome(
            lambda: global_norm([distribute_tensor(torch.ones(2), mesh, [Partial()])]))
        queue.put((rank, out))
        torch.distributed.destroy_process_group()
    except Exception:  # report instead of hanging the parent
        import traceback

        queue.put((rank, "error", traceback.format_exc()))


@pytest.fixture(scope="module")
def results():
    port = free_port()
    out = sorted(run_spawned(worker, [(r, port) for r in range(WORLD)], timeout=100),
                 key=lambda r: r[0])
    for r in out:
        assert r[1] != "error", r[2]
    return [r[1] for r in out]


def test_clip_matches_torch_on_whole_tensors(results):
    for out in results:
        for norm, ref in out["norms"]:
            assert norm == pytest.approx(ref, rel=1e-6)
        assert out["norms"][1][0] > 0.5  # the clipped steps did clip
        assert max(out["clip_err"]) < 1e-6
        sharded, want = out["sharded_norm"]
        assert sharded == pytest.approx(want, rel=1e-6)
    assert results[0]["norms"] == results[1]["norms"]  # identical on every rank
    assert "Partial" in results[0]["partial"]


def test_fused_clip_and_step_is_clip_then_adamw(results):
    """The clipping folded into the fused AdamW's grad_scale: the norm, the gradients left
    behind (clipped) and the stepped parameters are torch's clip_grad_norm_ + fused AdamW's to
    fp32 rounding (a division by 1/coef where torch multiplies by coef)."""
    for out in results:
        for i, (norm, ref, grad_err, param_err) in enumerate(out["fused"]):
            assert norm == pytest.approx(ref, rel=1e-6)
            assert grad_err < 1e-6 and param_err < 1e-6, (i, grad_err, param_err)
        assert out["fused"][1][0] > 0.5  # the clipped steps did clip
        assert "fused" in out["unfused_grad_scale"]


def test_adamw_is_torchs_and_resumes(results):
    for out in results:
        assert out["adam_equal"][0], "unclipped step: AdamW on shards == AdamW on whole tensors"
        assert max(out["param_err"]) < 1e-6
        assert out["state_placements"]
        assert out["resumed_equal"]
