"""--optimizer-offload none | fsdp | chunked on 2 gloo ranks: 4 steps give bitwise equal losses and
parameters in every mode; save at step 2 + resume to step 4 equals the uninterrupted run for
every mode (fp32 lm_head, fp32 sinks and routers), with the chunk size changed between save and
load and across modes (the state layout is per parameter, not per chunk)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from sglang_dsv41.ports import free_port
from trainer_bridge.dist import run_spawned

pytestmark = pytest.mark.timeout(240)
WORLD = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Chunks of 1310 and 393 elements: parameters are split mid-tensor, at different places.
CHUNK_MB, OTHER_CHUNK_MB = 0.01, 0.003


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_offload",
                                                  os.path.join(ROOT, "bench", "offload.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_params(policy) -> dict[str, np.ndarray]:
    # numpy: torch tensors would cross the result queue as shared memory of an exited worker
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
            for n, p in policy.model.named_parameters()}


def run(bench, mesh, mode, chunk_mb, steps, ckpt_dir=None, save_at=None, resume_from=None):
    from trainer_bridge.checkpoint import load_checkpoint, save_checkpoint

    cfg = bench.model_config("tiny-v4")
    rank = torch.distributed.get_rank()
    policy, opt, sched = bench.build(cfg, mesh, torch.device("cpu"), mode, chunk_mb, steps=4)
    start = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, policy.model, opt, rank)
        sched.load_state_dict(state["scheduler"])
        start = state["step"]
    losses = []
    for step in range(start, steps):
        losses.append(bench.train_step(policy, opt, sched, bench.micro_batch(cfg, rank, step, 16)))
        if save_at == step + 1:
            save_checkpoint(ckpt_dir, step + 1, policy.model, opt,
                            {"scheduler": sched.state_dict()}, rank)
    state_dtypes = {str(v.dtype) for s in opt.state.values() for k, v in s.items() if k != "step"}
    return losses, full_params(policy), state_dtypes, opt


def worker(rank: int, port: int, tmp: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    from trainer_bridge.dist import close_distributed, init_distributed
    from trainer_bridge.optimizer_offload import ChunkedHostAdamW

    try:
        bench = load_bench()
        mesh = init_distributed(torch.device("cpu")).mesh
        out = {}
        for mode in ("none", "fsdp", "chunked"):
            ckpt = os.path.join(tmp, mode)
            losses, params, dtypes, opt = run(bench, mesh, mode, CHUNK_MB, 4, ckpt, save_at=2)
            out[mode] = (losses, params, dtypes)
            if mode == "chunked":
                assert isinstance(opt, ChunkedHostAdamW) and opt.pinned is not None
                out["chunked_host_state"] = all(
                    v.to_local().device.type == "cpu" for s in opt.state.values()
                    for k, v in s.items() if k != "step")
            # resume in the same mode, the chunk size changed for chunked
            chunk = OTHER_CHUNK_MB if mode == "chunked" else CHUNK_MB
            r_losses, r_params, r_dtypes, _ = run(
                bench, mesh, mode, chunk, 4, resume_from=os.path.join(ckpt, "step-000002"))
            out[f"{mode}_resumed"] = (losses[:2] + r_losses, r_params, r_dtypes)
        # across modes: a none checkpoint resumed chunked, a chunked one resumed by fsdp
        for saved, loaded in (("none", "chunked"), ("chunked", "fsdp")):
            r_losses, r_params, r_dtypes, _ = run(
                bench, mesh, loaded, OTHER_CHUNK_MB, 4,
                resume_from=os.path.join(tmp, saved, "step-000002"))
            out[f"{saved}->{loaded}"] = (out[saved][0][:2] + r_losses, r_params, r_dtypes)
        queue.put((rank, out))
        close_distributed()
    except Exception:
        import traceback

        queue.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("offload"))
    port = free_port()
    results = dict(run_spawned(worker, [(r, port, tmp) for r in range(WORLD)], timeout=200,
                               join_timeout=20))
    for r in results.values():
        assert not isinstance(r, str), r
    return results


def assert_bitwise(a, b, what: str) -> None:
    assert a[0] == b[0], f"{what}: losses {a[0]} != {b[0]}"
    assert a[1].keys() == b[1].keys()
    diff = [n for n in a[1] if not np.array_equal(a[1][n], b[1][n])]
    assert not diff, f"{what}: parameters differ: {diff[:5]}"


def test_modes_bitwise_equal_after_4_steps(runs):
    out = runs[0]
    none = out["none"]
    assert len(set(none[0])) == 4, "the losses should move from step to step"
    for mode in ("fsdp", "chunked"):
        assert_bitwise(none, out[mode], f"none vs {mode}")
    assert out["chunked_host_state"]
    for mode in ("fsdp", "chunked"):  # rank 1's own losses (not reduced) agree as well
        assert_bitwise(runs[1]["none"], runs[1][mode], f"rank 1 none vs {mode}")


@pytest.mark.parametrize("mode", ["none", "fsdp", "chunked", "none->chunked", "chunked->fsdp"])
def test_resume_at_step_2_equals_uninterrupted(runs, mode):
    for rank in range(WORLD):
        out = runs[rank]
        reference = out[mode.split("->")[0]]
        resumed = out[mode if "->" in mode else f"{mode}_resumed"]
        assert_bitwise(reference, resumed, f"{mode} rank {rank}")
        assert resumed[2] == {"torch.float32"}, f"{mode}: state dtypes {resumed[2]}"
    params = runs[0]["none"][1]
    assert params["head.weight"].dtype == np.float32  # fp32 lm_head
    assert any(n.endswith("attn_sink") for n in params) and any(".hc_" in n for n in params)
