"""The memory plan behind model.activation_checkpointing=auto (trainer_bridge/memory_plan.py):
the fit through two probes, the planned peak of a mix of plain and checkpointed layers, the
fewest layers checkpointed within a limit, and the refusal when nothing fits. The probes
themselves read the CUDA allocator (bench/train.py --checkpointing auto checks them against
measured peaks on a GPU); re-applying a policy to built layers is tested on FSDP2 in
test_trainer_long_context.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dsv41.model.dsv4.token_logprobs import logprob_chunk_rows
from trainer_bridge.config import ModelConfig
from trainer_bridge.memory_plan import (PLAIN, PROBE_TOKENS, RECOMPUTED, Linear, MemoryPlan,
                                        MemoryPlanError, fitting_or_refused, probe_length,
                                        unallocated_static)

GiB = 1 << 30


def plan_of(plain: list[float], recomputed: list[float], static: float = 10 * GiB,
            rest: float = GiB) -> MemoryPlan:
    """Layers keeping ``plain`` / ``recomputed`` bytes a token."""
    return MemoryPlan(static, {PLAIN: [Linear(0, b) for b in plain],
                               RECOMPUTED: [Linear(0, b) for b in recomputed]}, rest,
                      (2048, 4096))


def test_a_line_through_two_probes_gives_any_length():
    line = Linear.through(2048, 7 + 2048 * 3.5, 4096, 7 + 4096 * 3.5)
    assert line.fixed == pytest.approx(7) and line.per_token == pytest.approx(3.5)
    assert line.at(65536) == pytest.approx(7 + 65536 * 3.5)


def test_peak_adds_static_state_the_rest_and_the_most_the_layers_hold():
    plan = plan_of([4, 1, 2], [1, 1, 1])
    t = 1000
    base = 11 * GiB
    assert plan.peak(t, [PLAIN] * 3) == base + 7 * t
    # Layer 0 checkpointed: after the forward the layers keep 1 + 1 + 2 a token; in its
    # backward only it is left, recomputed (4): the peak is the larger, 4 a token.
    assert plan.peak(t, [RECOMPUTED, PLAIN, PLAIN]) == base + 4 * t
    # Layer 2 checkpointed: its recompute comes first, over layers 0 and 1 (4 + 1 + 2 = 7).
    assert plan.peak(t, [PLAIN, PLAIN, RECOMPUTED]) == base + 7 * t
    assert plan.peak(t, [RECOMPUTED] * 3) == base + 4 * t


def test_fitting_checkpoints_the_fewest_layers_where_they_lower_the_peak():
    plan = plan_of([4, 4, 4, 4], [1, 1, 1, 1])
    t = 1000
    base = 11 * GiB
    assert plan.fitting(t, base + 16 * t) == (PLAIN,) * 4
    # 16 a token plain; one checkpointed layer: 13 after the forward. The first layer is the
    # one to take (its recompute sits over nothing); the last one's over 12.
    assert plan.fitting(t, base + 13 * t) == (RECOMPUTED, PLAIN, PLAIN, PLAIN)
    assert plan.fitting(t, base + 10 * t) == (RECOMPUTED, RECOMPUTED, PLAIN, PLAIN)
    assert plan.fitting(t, base + 7 * t) == (RECOMPUTED, RECOMPUTED, RECOMPUTED, PLAIN)
    # The last layer checkpointed too keeps 1 instead of 4, but its backward comes first and
    # recomputes its 4 over the other three's 1 + 1 + 1: still 7.
    assert plan.peak(t, [RECOMPUTED] * 4) == base + 7 * t
    assert plan.fitting(t, base + 7 * t - 1) is None


def test_nothing_fitting_is_refused_with_the_plan_and_the_ways_out():
    plan = plan_of([4, 4], [1, 1])
    with pytest.raises(MemoryPlanError, match=r"micro-batch of 65536 tokens does not fit "
                       r"10\.00 GiB \(model.memory_fraction 0.5 of the device\) even with every "
                       r"layer checkpointed: memory plan @ 65536 tokens.*loss.token_budget"):
        fitting_or_refused(plan, 65536, 0.5, 20 * GiB, ["L0 r0", "L1 r4"])
    policies, limit = fitting_or_refused(plan, 65536, 0.9, 80 * GiB)
    assert policies == (PLAIN, PLAIN) and limit == 0.9 * 80 * GiB


def test_the_shorter_probe_holds_a_whole_logprob_chunk():
    chunk = logprob_chunk_rows(32000)
    assert probe_length(1 << 20, 32000) == 2 * chunk > PROBE_TOKENS
    assert probe_length(1 << 20, 129280) == PROBE_TOKENS  # V4.1-Flash's vocabulary
    assert probe_length(1000, 32000) == 1000


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_memory_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError, match=r"model.memory_fraction must lie in \(0, 1\]"):
        ModelConfig(model_path="tiny", memory_fraction=fraction)
    assert ModelConfig(model_path="tiny", activation_checkpointing="auto").memory_fraction < 1


@pytest.mark.parametrize("unsharded", [False, True])
def test_static_bytes_not_yet_allocated_count_the_gradients_micro_batches_hold(unsharded):
    """Adam's two fp32 moments of the trained parameters; with several micro-batches a step the
    fp32 gradients the earlier ones leave for the later (run AI: the trainer's two-micro-batch
    steps peaked 6.5-7.5 GiB over a plan without them); none on the device when offloaded."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    model[1].weight.requires_grad_(False)  # frozen: no moments, no gradient
    trained = 10 * 20 + 20 + 3
    policy = SimpleNamespace(model=model, accumulate_unsharded=unsharded)
    assert unallocated_static(policy, False, False) == 8 * trained
    assert unallocated_static(policy, False, True) == 12 * trained
    assert unallocated_static(policy, True, True) == 4 * trained
    assert unallocated_static(policy, True, False) == 0


@pytest.mark.parametrize("source,prompts,group,world,minis,expected", [
    ("server", 1, 1, 1, 1, False),   # one sample a step: one micro-batch
    ("server", 2, 4, 8, 1, False),   # one sample a rank
    ("server", 2, 4, 4, 1, True),    # two a rank: the token budget decides
    ("server", 2, 4, 4, 2, False),   # one a rank a mini-batch
    ("offline", 1, 1, 1, 1, True),   # a record holds any number of samples
])
def test_the_trainer_plans_for_accumulation_unless_a_rank_gets_one_sample(
        source, prompts, group, world, minis, expected):
    from trainer_bridge.config import load_config
    from trainer_bridge.trainer import Trainer

    overrides = [f"rollout.source={source}", f"rollout.prompts_per_step={prompts}",
                 f"rollout.group_size={group}", f"loss.mini_batches={minis}"]
    if source == "offline":
        overrides.append("rollout.offline_path=rollouts.jsonl")
    trainer = SimpleNamespace(cfg=load_config("tiny", None, overrides),
                              dist=SimpleNamespace(world_size=world))
    assert Trainer.may_accumulate(trainer) is expected
