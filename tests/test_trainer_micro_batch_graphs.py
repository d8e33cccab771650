"""model.cuda_graphs (trainer_bridge/micro_batch_graphs.py) against the plain forward_backward,
both on one rank with compute copies in bf16 (a gloo world of one on the CPU, where the graphed
function runs eagerly every time): the same loss sums, fp32 gradients, gradient norms and
stepped weights, bit for bit, over three optimizer steps of two micro-batches each, with layouts
that repeat and a new one (on-policy: no old logprobs), R3 routing replayed, reference
logprobs and a KL term, and ``zero_grad(set_to_none=True)`` between steps; the reference pass's no-grad forwards (logprobs,
the routing recorded); a frozen policy forwards only; what a run returns is the caller's; the
refusals. With the Triton AdamW (interpreted), runs whose last micro-batch leaves its gradients
pending (compute_copies.py) equal the written ones bit for bit, both paths; one micro-batch a
step makes no fp32 buffers for them. On CUDA: the second micro-batch of
a layout is captured and later ones replay the graph, with the plain path's results to the
kernels' own run-to-run spread, also after optimizer steps (the copies refreshed), the no-grad
forwards too; a capture that fails (a forward that synchronizes) is logged and its layout runs
eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from refusals import outcome

from sglang_dsv41.attention.triton_common import interpreting
from trainer_bridge.batch import Sample, pack
from trainer_bridge.dist import run_spawned

pytestmark = pytest.mark.timeout(300)
PRESET = "tiny"
LENGTHS = [[(23, 30), (41,)], [(23, 30), (41,)], [(23, 30), (19, 9)]]  # micro-batches a step
ONE_EACH = [[(23, 30)], [(41,)]]  # one micro-batch a step


def micro_batches(policy, step: int, r3: bool, lengths=LENGTHS) -> list:
    cfg = policy.config
    gen = torch.Generator().manual_seed(11 + step)
    rng = np.random.default_rng(11 + step)
    out = []
    for seqs in lengths[step]:
        samples = []
        for i, n in enumerate(seqs):
            toks = torch.randint(0, 256, (n,), generator=gen).tolist()
            routed = weights = None
            if r3:  # distinct experts per row, as a server's top-k
                shape = (n - 1, cfg.num_hidden_layers, cfg.n_routed_experts)
                routed = np.argsort(rng.random(shape), axis=-1)[..., :cfg.num_experts_per_tok]
                weights = rng.random(routed.shape).astype(np.float32)
            s = Sample(toks, [0] * 3 + [1] * (n - 3), [-2.0] * n, 1.0, 0,
                       routed_experts=routed, routed_weights=weights)
            s.advantage = (1.0, -0.5)[i % 2]
            samples.append(s)
        mb = pack(samples, policy.routed_layers, use_routing=r3, top_k=cfg.num_experts_per_tok)
        noise = torch.randn(mb.targets.shape, generator=gen)
        mb.old_logprobs = -2.0 + 0.1 * noise  # ratios around 1, some clipped
        if seqs == (19, 9):  # on-policy: the forward's own logprobs are the old ones
            mb.old_logprobs = None
        mb.ref_logprobs = -2.0 - 0.05 * noise
        out.append(mb)
    return out


def run_mode(mesh, graphs: bool, r3: bool, device=torch.device("cpu"),
             triton_adamw: bool = False, defer: bool = False, lengths=LENGTHS) -> dict:
    """``triton_adamw``: the Triton AdamW (interpreted on the CPU), the compute copies' reader;
    ``defer``: the trainer's Policy.micro_batch calls, so each step's last micro-batch leaves
    its copies' gradients pending for the step."""
    from trainer_bridge.config import LossConfig, ModelConfig, OptimConfig
    from trainer_bridge.micro_batch_graphs import MicroBatchGraphs
    from trainer_bridge.policy import build_policy
    from trainer_bridge.schedule import build_optimizer
    from trainer_bridge.trainer import clip_and_step

    policy = build_policy(ModelConfig(model_path=PRESET, compute_dtype="bfloat16",
                                      one_rank="copies"), mesh, device)
    loss_cfg = LossConfig(kl_coef=0.1)
    if graphs:
        policy.graphs = MicroBatchGraphs(policy, loss_cfg, world_size=1)
    opt, _ = build_optimizer(policy, OptimConfig(
        lr=1e-2, adamw_kernel="triton" if triton_adamw else "auto"), 3)
    out = {"steps": [], "pending": []}
    for step in range(len(lengths)):
        mbs = micro_batches(policy, step, r3, lengths)
        tokens = sum(float(mb.loss_mask.sum()) for mb in mbs)
        passes = [reference_pass(policy, mb, r3) for mb in mbs]
        sums = train_micro_batches(policy, mbs, tokens, loss_cfg, r3, defer)
        # copies: the graphed path's gradient buffers persist (a numpy view would change)
        grads = gradients(policy)
        out["pending"].append(len(policy.model.compute_copies.pending))
        norm = clip_and_step(opt, 1.0).item()
        opt.zero_grad(set_to_none=True)
        out["steps"].append((sums, grads, norm, passes))
    out["weights"] = {n: p.detach().float().cpu().numpy().copy()
                      for n, p in policy.model.named_parameters()}
    out["dtypes"] = sorted({str(p.dtype) for p in policy.model.parameters()})
    out["counts"] = dict(policy.graphs.counts) if graphs else None
    out["layouts"] = len(policy.graphs.layouts) if graphs else None
    out["fp32 buffers"] = len(policy.graphs.grad_buffers) if graphs else None
    return out


def train_micro_batches(policy, mbs, tokens: float, loss_cfg, replay: bool, defer: bool
                        ) -> list:
    """forward_backward over a step's micro-batches -> their numpy loss sums; ``defer``: with
    the trainer's Policy.micro_batch calls (the last one's gradients stay pending)."""
    from trainer_bridge.trainer import forward_backward

    sums = []
    for i, mb in enumerate(mbs):
        if defer:
            policy.micro_batch(i, len(mbs))
        sums.append(forward_backward(policy, mb, tokens, loss_cfg, 1, replay=replay
                                     ).cpu().numpy())
    return sums


def gradients(policy) -> dict:
    """name -> the parameter's gradient: its .grad plus its pending one (compute_copies.py),
    read without settling them (the step must find them pending)."""
    pending = policy.model.compute_copies.pending_by_master()
    out = {}
    for n, p in policy.model.named_parameters():
        parts = [t.detach().float() for t in (p.grad, pending.get(id(p))) if t is not None]
        if parts:  # fp32 += pending, as the step adds them; a copy (the buffers persist)
            out[n] = (parts[0] + parts[1] if len(parts) == 2 else parts[0]).cpu().numpy().copy()
    return out


def reference_pass(policy, mb, replay: bool) -> tuple:
    """The trainer's no-grad forwards (Trainer.reference_pass): with the routing recorded, and
    without -> numpy (logprobs, {layer: (ids, weights)}, logprobs)."""
    with torch.no_grad():
        recorded = policy.forward(mb, replay=replay, record_routing=True)
        plain = policy.forward(mb, replay=replay)
    assert plain.routed == {}
    return (recorded.logprobs.cpu().numpy().copy(),
            {k: (i.cpu().numpy().copy(), w.cpu().numpy().copy())
             for k, (i, w) in recorded.routed.items()},
            plain.logprobs.cpu().numpy().copy())


def both_modes(mesh, sample):
    out = {(graphs, r3): run_mode(mesh, graphs, r3) for r3 in (False, True)
           for graphs in (False, True)}
    if interpreting():  # the Triton AdamW on the CPU (interpreted: two steps, ~10 s a run)
        out["triton"] = run_mode(mesh, False, False, triton_adamw=True, lengths=LENGTHS[:2])
        for graphs in (False, True):
            out[("deferred", graphs)] = run_mode(mesh, graphs, False, triton_adamw=True,
                                                 defer=True, lengths=LENGTHS[:2])
        out["triton one each"] = run_mode(mesh, False, False, triton_adamw=True,
                                          lengths=ONE_EACH)
        out["deferred one each"] = run_mode(mesh, True, False, triton_adamw=True, defer=True,
                                            lengths=ONE_EACH)
    return out


@pytest.fixture(scope="module")
def runs():
    from test_trainer_long_context import on_world_of_one

    (out,) = run_spawned(on_world_of_one, [(both_modes,)], timeout=280)
    assert isinstance(out, dict), out
    return out


@pytest.mark.parametrize("r3", [False, True])
def test_graphed_function_equals_plain_path(runs, r3):
    plain, graphed = runs[(False, r3)], runs[(True, r3)]
    # On the CPU every run is eager: 6 micro-batches, each with two no-grad forwards; 3 training
    # layouts and 6 forward ones were met, the least recently used past 8 dropped.
    assert graphed["counts"] == {"eager": 18, "captured": 0, "replayed": 0,
                                 "capture_failed": 0}
    assert graphed["layouts"] == 8
    for step, ((sums_a, grads_a, norm_a, passes_a), (sums_b, grads_b, norm_b, passes_b)) in \
            enumerate(zip(plain["steps"], graphed["steps"])):
        for (logp_a, routed_a, bare_a), (logp_b, routed_b, bare_b) in zip(passes_a, passes_b):
            assert np.array_equal(logp_a, logp_b) and np.array_equal(bare_a, bare_b), step
            assert np.array_equal(logp_a, bare_a), step
            assert set(routed_a) == set(routed_b) == set(range(len(routed_a))), step
            assert len(routed_a) > 1
            for k, (ids, w) in routed_a.items():
                assert np.array_equal(ids, routed_b[k][0]) and np.array_equal(w, routed_b[k][1])
        for a, b in zip(sums_a, sums_b):
            assert np.array_equal(a, b), f"step {step}: loss sums {a} vs {b}"
        assert sums_a[0][2] > 0, "the KL term took part"
        assert set(grads_a) == set(grads_b) and len(grads_a) > 50, step
        for name, g in grads_a.items():
            assert np.array_equal(g, grads_b[name]), f"step {step}: {name}"
        assert norm_a == norm_b, step
    for name, w in plain["weights"].items():
        assert np.array_equal(w, graphed["weights"][name]), name
    assert graphed["dtypes"] == ["torch.float32"]  # the masters back in the modules
    assert not np.array_equal(plain["steps"][0][1]["embed.weight"],
                              plain["steps"][1][1]["embed.weight"])  # the steps moved


@pytest.mark.skipif(not interpreting(), reason="the Triton AdamW on the CPU: TRITON_INTERPRET=1")
def test_pending_gradients_step_as_the_written_ones(runs):
    """The step's last micro-batch leaves its copies' gradients pending (both paths): the
    Triton AdamW's norm and step read them there, and the run equals the same optimizer's
    over fp32 gradients written as before, bit for bit (the kernel adds fp32 + pending as
    the written path's fp32 += does)."""
    written = runs["triton"]
    assert written["pending"] == [0, 0]
    for graphs in (False, True):
        deferred = runs[("deferred", graphs)]
        assert all(n > 50 for n in deferred["pending"]), deferred["pending"]
        for step, ((sums_a, grads_a, norm_a, _), (sums_b, grads_b, norm_b, _)) in enumerate(
                zip(written["steps"], deferred["steps"])):
            assert all(np.array_equal(a, b) for a, b in zip(sums_a, sums_b)), (graphs, step)
            assert set(grads_a) == set(grads_b), (graphs, step)
            for name, g in grads_a.items():
                assert np.array_equal(g, grads_b[name]), (graphs, step, name)
            assert norm_a == norm_b, (graphs, step)
        for name, w in written["weights"].items():
            assert np.array_equal(w, deferred["weights"][name]), (graphs, name)
    # One micro-batch a step: the copies' gradients never reach fp32, nor get buffers for it
    # (only the parameters kept fp32 do); the same weights.
    written, deferred = runs["triton one each"], runs["deferred one each"]
    held = deferred["pending"][0]
    assert held > 50 and deferred["pending"] == [held] * len(ONE_EACH)
    assert deferred["fp32 buffers"] == len(deferred["steps"][0][1]) - held
    for name, w in written["weights"].items():
        assert np.array_equal(w, deferred["weights"][name]), name


def refusals(mesh, sample):
    from trainer_bridge.config import LossConfig, ModelConfig
    from trainer_bridge.micro_batch_graphs import MicroBatchGraphs
    from trainer_bridge.policy import build_policy
    from trainer_bridge.trainer import forward_backward

    out = {}
    fsdp = build_policy(ModelConfig(model_path=PRESET, one_rank="fsdp"), mesh,
                        torch.device("cpu"))
    out["fsdp"] = outcome(lambda: MicroBatchGraphs(fsdp, LossConfig(), 1))
    policy = build_policy(ModelConfig(model_path=PRESET, compute_dtype="bfloat16",
                                      one_rank="copies"), mesh, torch.device("cpu"))
    policy.graphs = MicroBatchGraphs(policy, LossConfig(), 1)
    mb = pack([sample], policy.routed_layers, use_routing=False)
    for name, call in {
        "routing check": lambda: forward_backward(policy, mb, 36.0, LossConfig(), 1, False,
                                                  routing_check=lambda routed: None),
        "other loss": lambda: forward_backward(policy, mb, 36.0, LossConfig(kl_coef=0.5), 1,
                                               False),
        "world size": lambda: forward_backward(policy, mb, 36.0, LossConfig(), 2, False),
        "no tokens": lambda: forward_backward(policy, mb, 0.0, LossConfig(), 1, False),
        "bad target": lambda: forward_backward(policy, bad, 36.0, LossConfig(), 1, False),
    }.items():
        if name == "other loss":
            mb.old_logprobs = torch.zeros_like(mb.rollout_logprobs)
            bad = pack([sample], policy.routed_layers, use_routing=False)
            bad.old_logprobs = mb.old_logprobs
            bad.targets[3] = policy.config.vocab_size
        out[name] = outcome(call)
    # nothing was added by the refused calls; a good one still runs
    out["grads after refusals"] = sum(p.grad is not None for p in policy.model.parameters())
    forward_backward(policy, mb, 36.0, LossConfig(), 1, False)
    out["grads after a good call"] = sum(p.grad is not None for p in policy.model.parameters())
    return out


def test_refusals():
    from test_trainer_long_context import on_world_of_one

    (out,) = run_spawned(on_world_of_one, [(refusals,)], timeout=150)
    assert isinstance(out, dict), out
    assert "one rank without FSDP" in out["fsdp"]
    assert "record no routing" in out["routing check"]
    assert "another LossConfig" in out["other loss"]
    assert "world size 1, not 2" in out["world size"]
    assert "global_tokens must be positive" in out["no tokens"]
    assert "target" in out["bad target"] and out["bad target"] != "accepted"
    assert out["grads after refusals"] == 0
    assert out["grads after a good call"] > 50


def cuda_rounds(mesh, defer: bool = False) -> dict:
    """Three rounds on one policy: the plain path's sums and gradients, then the graphed
    path's at the same weights, then an optimizer step (with the graphed gradients). Round 0
    runs both layouts eagerly, round 1 captures them (after a step: the copies must be the
    stepped masters'), round 2 replays. ``defer``: as the trainer calls them, each last
    micro-batch's gradients stay pending for the Triton AdamW (CUDA's choice with copies):
    a replay's held gradients are its graph's static outputs."""
    from trainer_bridge.config import LossConfig, ModelConfig, OptimConfig
    from trainer_bridge.micro_batch_graphs import MicroBatchGraphs
    from trainer_bridge.policy import build_policy
    from trainer_bridge.schedule import build_optimizer
    from trainer_bridge.trainer import clip_and_step

    device = torch.device("cuda", 0)
    policy = build_policy(ModelConfig(model_path=PRESET, one_rank="copies"), mesh, device)
    loss_cfg = LossConfig(kl_coef=0.1)
    graphs = MicroBatchGraphs(policy, loss_cfg, world_size=1)
    opt, _ = build_optimizer(policy, OptimConfig(lr=1e-3), 3)
    mbs = micro_batches(policy, 0, r3=True)
    tokens = sum(float(mb.loss_mask.sum()) for mb in mbs)

    def run(runner):
        policy.graphs = runner
        passes = [reference_pass(policy, mb, True) for mb in mbs]
        sums = train_micro_batches(policy, mbs, tokens, loss_cfg, True, defer)
        pending.append(len(policy.model.compute_copies.pending))
        return sums, gradients(policy), passes

    rounds, pending = [], []
    for _ in range(3):
        plain = run(None)
        opt.zero_grad(set_to_none=True)
        graphed = run(graphs)
        clip_and_step(opt, 1.0)
        opt.zero_grad(set_to_none=True)
        rounds.append((plain, graphed))
    return {"rounds": rounds, "counts": dict(graphs.counts), "pending": pending,
            "host inputs": {k[0]: len(v.host_inputs) for k, v in graphs.layouts.items()
                            if k[-1] == "fresh"}}


def outputs_are_owned(mesh, sample):
    """A frozen policy (the KL reference: no trained parameters) with graphs: its no-grad
    forwards work, its forward_backward is refused; what a forward returns (a replayed
    routing it recorded) is the caller's, not a static input the next micro-batch of the
    layout overwrites."""
    from trainer_bridge.config import LossConfig, ModelConfig
    from trainer_bridge.micro_batch_graphs import MicroBatchGraphs
    from trainer_bridge.policy import build_policy
    from trainer_bridge.trainer import forward_backward

    policy = build_policy(ModelConfig(model_path=PRESET, compute_dtype="bfloat16",
                                      one_rank="copies"), mesh, torch.device("cpu"),
                          trainable=False)
    policy.graphs = MicroBatchGraphs(policy, LossConfig(), 1)
    first, second = micro_batches(policy, 0, r3=True)[0], micro_batches(policy, 1, r3=True)[0]
    assert first.seq_lens == second.seq_lens  # one layout
    with torch.no_grad():
        kept = policy.forward(first, replay=True, record_routing=True)
        layer = policy.replayed_layers[0]
        before = kept.routed[layer][1].clone()
        policy.forward(second, replay=True, record_routing=True)
    out = {"kept": torch.equal(kept.routed[layer][1], before),
           "replayed": torch.equal(before, first.routing[layer][1])}
    out["train"] = outcome(lambda: forward_backward(policy, first, 10.0, LossConfig(), 1,
                                                    replay=True))
    return out


def test_forward_outputs_are_owned_and_frozen_policies_forward_only():
    from test_trainer_long_context import on_world_of_one

    (out,) = run_spawned(on_world_of_one, [(outputs_are_owned,)], timeout=150)
    assert isinstance(out, dict), out
    assert out["replayed"] and out["kept"]
    assert "no trained parameters" in out["train"]


def on_cuda(body, queue) -> None:
    """Runs body(mesh) as rank 0 of a world of one on CUDA device 0 and puts its result (or the
    traceback) on the queue."""
    import os

    from sglang_dsv41.ports import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), LOCAL_WORLD_SIZE="1")
    from trainer_bridge.dist import close_distributed, init_distributed

    try:
        queue.put(body(init_distributed(torch.device("cuda", 0)).mesh))
        close_distributed()
    except Exception:
        import traceback

        queue.put(traceback.format_exc())


def cuda_rounds_deferred(mesh) -> dict:
    return cuda_rounds(mesh, defer=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("defer", [False, True], ids=["written", "pending"])
def test_graphs_capture_and_replay_on_cuda(defer):
    (out,) = run_spawned(on_cuda, [(cuda_rounds_deferred if defer else cuda_rounds,)],
                         timeout=280)
    assert isinstance(out, dict), out
    assert all((n > 50) == defer for n in out["pending"]), out["pending"]
    # 6 layouts (2 micro-batches x fresh or accumulating training, forward with and without
    # the routing recorded): eager in round 0, captured in round 1, replayed in rounds 1-2
    assert out["counts"] == {"eager": 6, "captured": 6, "replayed": 12, "capture_failed": 0}
    # the packed layout's per-sequence tables are copied from host memory the graph keeps
    assert out["host inputs"][(23, 30)] > 0, out["host inputs"]
    for i, ((sums_a, grads_a, passes_a), (sums_b, grads_b, passes_b)) in enumerate(
            out["rounds"]):
        for (logp_a, routed_a, _), (logp_b, routed_b, _) in zip(passes_a, passes_b):
            assert np.allclose(logp_a, logp_b, rtol=1e-3, atol=1e-3), i
            for k, (ids, _) in routed_a.items():
                assert np.array_equal(ids, routed_b[k][0]), (i, k)
        for x, y in zip(sums_a, sums_b):  # within the kernels' atomics (bf16 compute)
            assert np.allclose(x, y, rtol=1e-3, atol=1e-5), f"round {i}: sums {x} vs {y}"
        assert set(grads_a) == set(grads_b), i
        for name, g in grads_a.items():
            want = grads_b[name]
            assert np.abs(g - want).max() <= 1e-2 * max(np.abs(want).max(), 1e-6), (i, name)


def failing_capture(mesh) -> dict:
    """A forward that makes the host wait for the GPU (a synchronize, which a capture cannot
    hold): the capture fails, is logged, and the layout runs eagerly with the right result."""
    import logging

    from trainer_bridge.config import LossConfig, ModelConfig
    from trainer_bridge.micro_batch_graphs import MicroBatchGraphs
    from trainer_bridge.policy import build_policy
    from trainer_bridge.trainer import forward_backward

    device = torch.device("cuda", 0)
    policy = build_policy(ModelConfig(model_path=PRESET, one_rank="copies"), mesh, device)
    policy.model.layers[0].register_forward_pre_hook(lambda *_: torch.cuda.synchronize())
    loss_cfg = LossConfig()
    graphs = MicroBatchGraphs(policy, loss_cfg, world_size=1)
    mb = micro_batches(policy, 0, r3=False)[1]
    tokens = float(mb.loss_mask.sum())
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("trainer_bridge").addHandler(handler)
    sums = []
    for runner in (None, graphs, graphs, graphs):
        policy.graphs = runner
        sums.append(forward_backward(policy, mb, tokens, loss_cfg, 1, replay=False).cpu())
        for p in policy.model.parameters():
            p.grad = None
    return {"sums": [s.numpy() for s in sums], "counts": dict(graphs.counts),
            "warnings": warnings}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_failed_capture_runs_eagerly():
    (out,) = run_spawned(on_cuda, [(failing_capture,)], timeout=200)
    assert isinstance(out, dict), out
    assert out["counts"] == {"eager": 3, "captured": 0, "replayed": 0, "capture_failed": 1}
    assert any("capture" in w and "runs eagerly" in w for w in out["warnings"]), out["warnings"]
    for s in out["sums"][1:]:
        assert np.allclose(s, out["sums"][0], rtol=1e-3, atol=1e-5), (s, out["sums"][0])
