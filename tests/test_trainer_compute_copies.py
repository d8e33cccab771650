"""One rank without FSDP (model.one_rank=copies, trainer_bridge/compute_copies.py) against FSDP2
on the same rank, both in bf16 compute on the CPU (a gloo world of one): the same logprobs and
the same fp32 gradients, bit for bit, over two optimizer steps of two micro-batches each (the
second step sees the copies refreshed from the stepped masters), with and without activation
checkpointing; fp32 masters in the modules between steps; a DCP checkpoint resumes in the other
mode (parameters without optimizer state stay so); a fused AdamW step refreshes the copies;
the refusals; on CUDA, the first step within the kernels' atomics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from refusals import outcome

from sglang_dsv41.attention.triton_common import interpreting
from trainer_bridge.batch import Sample, pack
from trainer_bridge.dist import run_spawned

pytestmark = pytest.mark.timeout(240)
PRESET = "tiny"


def samples(step: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(7 + step)
    out = []
    for n in (23, 30):  # past the window (16) and several compression blocks
        toks = torch.randint(0, 256, (n,), generator=gen).tolist()
        s = Sample(toks, [0] * 4 + [1] * (n - 4), [0.0] * n, 1.0, 0)
        s.advantage = 1.0 if n == 23 else -0.5
        out.append(s)
    return out


def full(t):
    """A numpy copy (not a view: the clipping scales the gradients in place afterwards)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu(
        ).numpy().copy()


def run_mode(mesh, one_rank: str, checkpointing: str, device=torch.device("cpu"),
             adamw_kernel: str = "auto") -> dict:
    from trainer_bridge.config import ModelConfig, OptimConfig
    from trainer_bridge.policy import build_policy
    from trainer_bridge.schedule import build_optimizer
    from trainer_bridge.trainer import clip_and_step

    policy = build_policy(ModelConfig(model_path=PRESET, compute_dtype="bfloat16",
                                      one_rank=one_rank, accumulate_unsharded="never",
                                      activation_checkpointing=checkpointing),
                          mesh, device)
    opt, _ = build_optimizer(policy, OptimConfig(lr=1e-2, adamw_kernel=adamw_kernel), 2)
    out = {"copies": hasattr(policy.model, "compute_copies"), "steps": [], "refresh_due": [],
           "head_gemm": policy.model.head.fp32_gemm}  # model.lm_head_gemm auto, on the CPU
    for step in range(2):
        logps = []
        for s in samples(step):  # two micro-batches a step: the gradients accumulate
            mb = pack([s], policy.routed_layers, use_routing=False)
            res = policy.forward(mb, replay=False)
            weights = (mb.advantages * mb.loss_mask).to(device)
            (-(res.logprobs * weights).sum()).backward()
            res.release()
            logps.append(res.logprobs.detach().cpu().numpy())
        # numpy across the process boundary (tensors would travel as shared-memory handles)
        grads = {n: (str(p.grad.dtype), full(p.grad))
                 for n, p in policy.model.named_parameters() if p.grad is not None}
        norm = clip_and_step(opt, 1.0)  # clips (the norm is ~50): the same coefficient
        # whether the copies wait for a refresh (torch's AdamW) or the step wrote them (Triton)
        out["refresh_due"].append(getattr(policy.model, "compute_copies", None) is not None
                                  and policy.model.compute_copies._stepped)
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            plain = policy.forward(pack(samples(5)[:1], policy.routed_layers,
                                        use_routing=False), replay=False).logprobs.cpu().numpy()
        # The copies the no-grad forward used are the stepped masters' (CUDA: fused AdamW,
        # which leaves the masters' version counters as they were).
        copies = getattr(policy.model, "compute_copies", None)
        fresh = copies is None or all(torch.equal(c, m.to(c.dtype))
                                      for c, m in zip(copies.copies, copies.masters))
        out["steps"].append((logps, grads, norm.item(), plain, fresh))
    out["dtypes"] = {n: str(p.dtype) for n, p in policy.model.named_parameters()}
    out["state"] = sorted(policy.model.state_dict())
    return out


def both_modes(mesh, sample):
    from sglang_dsv41.attention.triton_common import interpreting

    out = {(mode, ac): run_mode(mesh, mode, ac) for ac in ("none", "layer")
           for mode in ("fsdp", "copies")}
    if interpreting():  # the Triton AdamW (CUDA's default with copies), interpreted
        out[("copies+triton", "none")] = run_mode(mesh, "copies", "none",
                                                  adamw_kernel="triton")
    return out


@pytest.fixture(scope="module")
def runs():
    from test_trainer_long_context import on_world_of_one

    (out,) = run_spawned(on_world_of_one, [(both_modes,)], timeout=220)
    assert isinstance(out, dict), out
    return out


@pytest.mark.parametrize("checkpointing", ["none", "layer"])
def test_copies_equal_fsdp_on_one_rank(runs, checkpointing):
    fsdp, copies = runs[("fsdp", checkpointing)], runs[("copies", checkpointing)]
    assert copies["copies"] and not fsdp["copies"]
    assert fsdp["head_gemm"] == copies["head_gemm"] == "ieee"
    for step, (a, b) in enumerate(zip(fsdp["steps"], copies["steps"])):
        (logps_a, grads_a, norm_a, plain_a, _), (logps_b, grads_b, norm_b, plain_b, fresh) = a, b
        assert fresh, f"step {step}: the copies are not the stepped masters'"
        for x, y in zip(logps_a, logps_b):
            assert np.array_equal(x, y), f"step {step}: logprobs differ"
        assert set(grads_a) == set(grads_b) and len(grads_a) > 50
        for name, (_, g) in grads_a.items():
            assert grads_b[name][0] == "torch.float32", name
            assert np.array_equal(g, grads_b[name][1]), f"step {step}: {name}"
        assert norm_a == norm_b
        assert np.array_equal(plain_a, plain_b), f"step {step}: the no-grad forward differs"
    # The trained weights moved: the second step's logprobs are not the first's.
    assert not np.array_equal(copies["steps"][0][3], copies["steps"][1][3])
    # Between steps the modules hold the fp32 masters, under the names FSDP's checkpoints use.
    assert set(copies["dtypes"].values()) == {"torch.float32"}
    assert fsdp["state"] == copies["state"]


@pytest.mark.skipif(not interpreting(), reason="the Triton AdamW on the CPU: TRITON_INTERPRET=1")
def test_triton_adamw_writes_the_copies_in_the_trainer_step(runs):
    """The trainer's step through the Triton AdamW (optim.adamw_kernel=triton, CUDA's choice
    with copies): the copies are the stepped masters with no refresh, and the run follows
    torch's AdamW (the same gradients; the norm to fp32 rounding: the kernel's sums of squares
    go chunk by chunk, torch's tensor by tensor; then weights equal to fp32 rounding, so the
    bf16 copies and logprobs agree closely, not to the bit)."""
    torch_run, triton_run = runs[("copies", "none")], runs[("copies+triton", "none")]
    (logps_a, grads_a, norm_a, plain_a, _), (logps_b, grads_b, norm_b, _, _) = (
        torch_run["steps"][0], triton_run["steps"][0])
    assert all(np.array_equal(x, y) for x, y in zip(logps_a, logps_b))
    assert abs(norm_a - norm_b) <= 1e-6 * norm_a and all(np.array_equal(g, grads_b[n][1])
                                                         for n, (_, g) in grads_a.items())
    # After the step: a master 1 fp32 ulp off rounds to the other bf16 value now and then,
    # which moves bf16 logprobs by a few 1e-3; the step itself moved them ~50x more. (After a
    # second step the runs part further: AdamW's update is about lr x sign(gradient) where a
    # gradient is near zero, and those signs follow the first step's roundings. The kernel's
    # update is checked against torch's element by element in test_trainer_adamw_triton.py.)
    moved = np.abs(plain_a - torch_run["steps"][1][3]).max()
    diff = np.abs(plain_a - triton_run["steps"][0][3]).max()
    assert diff < 1e-2 and diff < moved / 20, (diff, moved)
    assert all(fresh for *_, fresh in triton_run["steps"]), "copies not the stepped masters'"
    assert torch_run["refresh_due"] == [True, True] and triton_run["refresh_due"] == [False,
                                                                                     False]


def refusals(mesh, sample):
    from trainer_bridge.config import ModelConfig
    from trainer_bridge.parallelize import uses_compute_copies
    from trainer_bridge.policy import load_policy_model

    model = load_policy_model(PRESET)
    out = {"cpu auto": uses_compute_copies(model, mesh, torch.bfloat16, "auto"),
           "offload auto": uses_compute_copies(model, mesh, torch.bfloat16, "auto", "fsdp")}
    for args in (("copies", "fsdp"), ("sometimes", "none")):
        out[args] = outcome(lambda: uses_compute_copies(model, mesh, torch.bfloat16, *args))
    out["config"] = outcome(lambda: ModelConfig(one_rank="plain"))
    return out


def test_one_rank_choices_and_refusals():
    from test_trainer_long_context import on_world_of_one

    (out,) = run_spawned(on_world_of_one, [(refusals,)], timeout=100)
    assert isinstance(out, dict), out
    # auto: FSDP on the CPU (copies only where they fit a CUDA device) and with offload.
    assert out["cpu auto"] is False and out["offload auto"] is False
    assert "not with optimizer offload 'fsdp'" in out[("copies", "fsdp")]
    assert "choose from" in out[("sometimes", "none")]
    assert "model.one_rank" in out["config"] and "copies" in out["config"]


def cuda_worker(queue) -> None:
    import os

    from sglang_dsv41.ports import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), LOCAL_WORLD_SIZE="1")
    from trainer_bridge.dist import close_distributed, init_distributed

    try:
        mesh = init_distributed(torch.device("cuda", 0)).mesh
        queue.put({mode: run_mode(mesh, mode, "none", torch.device("cuda", 0))
                   for mode in ("fsdp", "copies")})
        close_distributed()
    except Exception:
        import traceback

        queue.put(traceback.format_exc())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copies_match_fsdp_on_cuda():
    """On CUDA (bf16 compute, the Triton kernels) the modes' first step agrees to the kernels'
    own run-to-run spread (the attention backward and the MoE combine add with atomics); after
    each optimizer step the copies hold the stepped masters."""
    (out,) = run_spawned(cuda_worker, [()], timeout=220)
    assert isinstance(out, dict), out
    assert out["copies"]["copies"] and not out["fsdp"]["copies"]
    for step, (a, b) in enumerate(zip(out["fsdp"]["steps"], out["copies"]["steps"])):
        for x, y in zip(a[0], b[0]):
            assert np.abs(x - y).max() < 1e-4, f"step {step}: logprobs"
        for name, (_, g) in a[1].items():
            want = b[1][name][1]
            assert np.abs(g - want).max() <= 1e-2 * max(np.abs(want).max(), 1e-6), name
        # After the optimizer step the modes' weights differ where a gradient was near zero:
        # AdamW's first update is about lr x sign(gradient), and the sign of noise flips.
        assert b[4], f"step {step}: the copies are not the stepped masters'"
        if step == 0:
            break


def test_copies_follow_a_fused_optimizer_step():
    """torch's fused AdamW updates the masters without bumping their version counters: the
    copies still refresh (the global step hook) and the gradients reach the masters in fp32."""
    from trainer_bridge.compute_copies import ComputeCopies

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    copies = ComputeCopies(model, torch.bfloat16, keeps_fp32=lambda name: False)
    assert len(copies.masters) == 4
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for _ in range(2):
        model(x).float().sum().backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32
                   for p in model.parameters())
        assert all(c.grad is None for c in copies.copies)
        before = [m.detach().clone() for m in copies.masters]
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert not all(torch.equal(b, m) for b, m in zip(before, copies.masters))
        with torch.no_grad():
            model(x)
        assert all(torch.equal(c, m.to(torch.bfloat16))
                   for c, m in zip(copies.copies, copies.masters))
        assert all(p.dtype == torch.float32 for p in model.parameters())  # masters back
    # An optimizer of other parameters (a frozen reference model's copies see its steps) does
    # not mark these copies stale.
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    other.param_groups[0]["params"][0].grad = torch.ones(2)
    other.step()
    assert not copies._stepped


def resume_across_modes(saving: str, loading: str, mesh, sample):
    """A DCP checkpoint of one optimizer step saved in one mode and loaded in the other, on the
    same rank (copies -> FSDP as a multi-GPU resume of a one-GPU run would shard it): every
    weight and Adam moment comes back, and the parameters that had no optimizer state (no
    gradient yet) still have none."""
    import tempfile

    from trainer_bridge.checkpoint import load_checkpoint, save_checkpoint
    from trainer_bridge.config import ModelConfig, OptimConfig
    from trainer_bridge.policy import build_policy
    from trainer_bridge.schedule import build_optimizer

    def built(one_rank):
        policy = build_policy(ModelConfig(model_path=PRESET, compute_dtype="bfloat16",
                                          one_rank=one_rank), mesh, torch.device("cpu"))
        return policy, build_optimizer(policy, OptimConfig(lr=1e-2), 2)[0]

    saved, opt = built(saving)
    mb = pack([sample], saved.routed_layers, use_routing=False)
    (-(saved.forward(mb, replay=False).logprobs * mb.loss_mask).sum()).backward()
    opt.step()
    with tempfile.TemporaryDirectory() as root:
        path = save_checkpoint(root, 1, saved.model, opt, {"step": 1}, rank=0)
        loaded, opt2 = built(loading)
        state = load_checkpoint(path, loaded.model, opt2, rank=0)
    want = dict(saved.model.named_parameters())
    got = dict(loaded.model.named_parameters())
    moments = {n: opt.state[p]["exp_avg"] for n, p in want.items() if p in opt.state}
    # Saved without optimizer state (no gradient yet on one rank: the indexers), loaded so.
    stateless = sorted(n for n, p in want.items() if p.requires_grad and p not in opt.state)
    return {"step": state["step"], "names": sorted(want) == sorted(got),
            "stateless": bool(stateless) and stateless == sorted(
                n for n, p in got.items() if p.requires_grad and p not in opt2.state),
            "weights": all(torch.equal(full_tensor(got[n]), full_tensor(p))
                           for n, p in want.items()),
            "moments": len(moments) > 50 and all(
                torch.equal(full_tensor(opt2.state[got[n]]["exp_avg"]), full_tensor(m))
                for n, m in moments.items())}


def full_tensor(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("saving, loading", [("copies", "fsdp"), ("fsdp", "copies")])
def test_checkpoint_resumes_in_the_other_mode(saving, loading):
    from functools import partial

    from test_trainer_long_context import on_world_of_one

    (out,) = run_spawned(on_world_of_one, [(partial(resume_across_modes, saving, loading),)],
                         timeout=100)
    assert out == {"step": 1, "names": True, "stateless": True, "weights": True,
                   "moments": True}, out
