"""Trainer bridge pieces that need no process group: config, advantages, loss, schedule,
packing, environments."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from sglang_dsv41.model.dsv4.names import is_frozen_table
from sglang_dsv41.router.base import SessionRouter
from sglang_dsv41.tokenizer import ByteTokenizer
from trainer_bridge.batch import Sample, pack, split_by_token_budget
from trainer_bridge.config import LossConfig, load_config
from trainer_bridge.envs import make_env
from trainer_bridge.loss import compute_advantages, k3_kl, loss_scale, ppo_loss
from trainer_bridge.parallelize import is_fp32_param, server_param_name
from trainer_bridge.schedule import SinkWarmupLR
from trainer_bridge.trainer import routing_agreement


def sample(reward=0.0, group=0, n=6, gen=3, routed=None):
    return Sample(list(range(n)), [0] * (n - gen) + [1] * gen, [0.0] * (n - gen) + [-1.0] * gen,
                  reward, group, routed_experts=routed, routed_weights=None if routed is None
                  else np.ones(routed.shape, np.float32))


def test_config_overrides_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("loss: {kl_coef: 0.5}\nrollout: {env_args: {target: xyz}}\n")
    cfg = load_config("tiny", str(f), ["steps=7", "optim.lr=0.1"])
    assert (cfg.steps, cfg.loss.kl_coef, cfg.optim.lr) == (7, 0.5, 0.1)
    assert cfg.rollout.env_args == {"target": "xyz"}
    for bad, msg in [("loss.nope=1", "unknown config key"), ("loss.advantage=x", "grpo"),
                     ("steps=0", "positive"), ("rollout.source=offline", "offline_path"),
                     ("noequals", "key=value")]:
        with pytest.raises(ValueError, match=msg):
            load_config("tiny", None, [bad])
    with pytest.raises(ValueError, match="unknown preset"):
        load_config("huge", None, [])
    with pytest.raises(ValueError, match="could not be converted"):
        load_config("tiny", None, ["steps=many"])
    assert load_config("tiny", None, ["rollout.server_urls=[http://h:1]"]).rollout.server_urls \
        == ["http://h:1"]


def test_parameter_roles_and_sglang_names():
    assert server_param_name("layers.3.attn.fp32_params.attn_sink") == "layers.3.attn.attn_sink"
    assert server_param_name("fp32_params.hc_head_fn") == "hc_head_fn"
    assert server_param_name("layers.0.fp32_params.hc_ffn_base") == "layers.0.hc_ffn_base"
    assert is_fp32_param("layers.0.attn.attn_sink") and is_fp32_param("layers.2.hc_attn_scale")
    assert not is_fp32_param("layers.0.attn.wq_a.weight")
    assert is_frozen_table("layers.1.engram.embed.weight")
    assert is_frozen_table("layers.1.engram.embed.scale")
    assert is_frozen_table("layers.0.ffn.gate.tid2eid")
    assert not is_frozen_table("layers.1.engram.wkv.weight")
    assert not is_frozen_table("layers.4.ffn.gate.bias")


def test_routing_agreement_counts_sets_per_layer_and_skips_last_positions():
    r = np.zeros((5, 2, 2), np.int32)
    r[:, 0] = [[1, 2]] * 5
    r[:, 1] = [[3, 4]] * 5
    mb = pack([sample(routed=r)], [0, 1], True)
    own = {0: (torch.tensor([[2, 1]] * 5 + [[7, 7]]), None),   # same set, other order; the
           1: (torch.tensor([[3, 4]] * 3 + [[3, 5]] * 3), None)}  # last row is never compared
    got = routing_agreement(own, mb, [0, 1])
    assert got.tolist() == [[5.0, 5.0], [3.0, 5.0]]
    assert routing_agreement({0: own[0]}, mb, [0, 1]).tolist() == [[5.0, 5.0], [0.0, 0.0]]


def test_grpo_and_ppo_advantages():
    s = [sample(1.0, 0), sample(0.0, 0), sample(5.0, 1), sample(5.0, 1)]
    compute_advantages(s, LossConfig(advantage="grpo"))
    assert s[0].advantage == pytest.approx(1.0, abs=1e-5)
    assert s[1].advantage == pytest.approx(-1.0, abs=1e-5)
    assert s[2].advantage == s[3].advantage == 0.0  # no signal inside a uniform group
    compute_advantages(s, LossConfig(advantage="ppo", normalize_std=False))
    assert [x.advantage for x in s] == pytest.approx([-1.75, -2.75, 2.25, 2.25])


def test_ppo_loss_clip_dual_clip_tis_and_normalisation():
    cfg = LossConfig(clip_eps=0.2, clip_eps_high=0.28, dual_clip_c=3.0, tis_cap=2.0)
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 10.0, 1.0])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    rollout = torch.tensor([0.0, 0.0, 0.0, math.log(0.25)])  # token 3: ratio old/rollout 4 -> 2
    mask = torch.ones(4)
    t = ppo_loss(logp, old, rollout, adv, mask, cfg, scale=loss_scale(8.0, world_size=2))
    # per token: A>0 ratio 1.5 clipped at 1.28; A<0 ratio .5 -> max(.5, .8) = .8;
    # A<0 ratio 10 -> dual clip min(10, 3) = 3; last: ratio 1, TIS weight min(4, 2) = 2.
    expected = (-1.28 + 0.8 + 3.0 + 2 * -1.0) * 2 / 8.0
    assert float(t.loss.detach()) == pytest.approx(expected, rel=1e-6)
    t.loss.backward()
    assert logp.grad[0] == 0 and logp.grad[2] == 0 and logp.grad[3] != 0  # clipped: no gradient
    assert t.clip_frac_sum == 2.0
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="global_tokens must be positive"):
            loss_scale(bad, world_size=1)
    # the scale as a 0-d tensor (what a captured CUDA graph reads): the same bits
    scale = torch.tensor(loss_scale(8.0, 2), dtype=torch.float32)
    again = ppo_loss(logp.detach(), old, rollout, adv, mask, cfg, scale=scale)
    assert torch.equal(again.loss, t.loss.detach())


def test_on_policy_ppo_loss_is_the_old_logprobs_own_and_sums_the_mismatch():
    """old_logp None (one optimizer step a batch, Trainer.on_policy): the forward's own
    logprobs are the old ones, detached: the loss, its gradient and the sums equal those of
    the same values passed as old logprobs; the mismatch against the rollout's logprobs is
    summed over the masked tokens (k3 in float64)."""
    cfg = LossConfig()
    logp = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.9])).requires_grad_()
    rollout = torch.log(torch.tensor([0.5, 0.5, 0.1, 0.9]))
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    on = ppo_loss(logp, None, rollout, adv, mask, cfg, scale=0.25)
    on.loss.backward()
    grad_on, logp.grad = logp.grad.clone(), None
    given = ppo_loss(logp, logp.detach().clone(), rollout, adv, mask, cfg, scale=0.25)
    given.loss.backward()
    assert torch.equal(on.sums(), given.sums()) and torch.equal(grad_on, logp.grad)
    assert on.clip_frac_sum == 0  # ratio 1 everywhere
    d = (logp.detach() - rollout)[:3]
    assert float(on.mismatch_abs_sum) == pytest.approx(float(d.abs().sum()), rel=1e-6)
    k3 = (torch.expm1(d.double()) - d.double()).sum()  # KL(rollout || old), k3
    assert float(on.mismatch_k3_sum) == pytest.approx(float(k3), rel=1e-9)
    assert on.sums().shape == (7,) and on.sums().dtype == torch.float64


def test_k3_kl_is_nonnegative_and_zero_at_equality():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(100, generator=gen)
    b = torch.randn(100, generator=gen)
    assert (k3_kl(a, b) >= 0).all()
    # Near-equal log-probs (the common case late in training): exp(d) - d - 1 in fp32 dips below 0.
    tiny = torch.logspace(-9, -2, 2000) * torch.tensor([1.0, -1.0]).repeat(1000)
    kl = k3_kl(torch.zeros(2000), tiny)
    assert (kl >= 0).all()
    assert torch.allclose(kl.double(), tiny.double() ** 2 / 2, rtol=1e-2, atol=1e-12)
    assert torch.allclose(k3_kl(a, a), torch.zeros(100))
    cfg = LossConfig(kl_coef=0.5)
    z = torch.zeros(3)
    t = ppo_loss(z, z, z, z, torch.ones(3), cfg, scale=loss_scale(3, world_size=1),
                 ref_logp=torch.full((3,), -1.0))
    assert float(t.loss) == pytest.approx(0.5 * (math.exp(-1) + 1 - 1))


def test_sink_warmup_schedule():
    lr = SinkWarmupLR(total_steps=20, frozen_frac=0.1, ramp_frac=0.4)
    got = [lr(s) for s in range(20)]
    assert got[:2] == [0.0, 0.0]
    assert got[2:10] == pytest.approx([(i + 1) / 8 for i in range(8)])
    assert got[10:] == [1.0] * 10


def test_pack_aligns_targets_masks_and_routing():
    r = np.arange(5 * 4 * 2, dtype=np.int32).reshape(5, 4, 2) % 8
    a, b = sample(1.0, n=6, routed=r), sample(0.0, n=4, gen=2, routed=r[:3])
    a.advantage, b.advantage = 2.0, -1.0
    mb = pack([a, b], routed_layers=[1, 2], use_routing=True)
    assert mb.input_ids.tolist() == list(range(6)) + list(range(4))
    assert mb.hidden_index.tolist() == [0, 1, 2, 3, 4, 6, 7, 8]
    assert mb.targets.tolist() == [1, 2, 3, 4, 5, 1, 2, 3]
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 1, 1]
    assert mb.advantages.tolist() == [2.0] * 5 + [-1.0] * 3
    ids, w = mb.routing[1]
    assert ids.shape == (10, 2) and w.dtype == torch.float32
    assert ids[:5].tolist() == r[:, 1].tolist() and ids[5].tolist() == r[4, 1].tolist()
    with pytest.raises(ValueError, match="-1 rows"):
        pack([sample(routed=np.full((5, 4, 2), -1, np.int32))], [1], True)
    with pytest.raises(ValueError, match="expected \\[positions"):
        pack([sample(routed=r)], [4], True)  # the server returned 4 layers, layer 4 asked
    dummy = pack([], [1], True)
    assert dummy.num_samples == 0 and dummy.num_loss_tokens == 0
    assert [len(g) for g in split_by_token_budget([a, b, a], budget=10)] == [2, 1]


def test_sample_validation_and_json_roundtrip():
    s = sample(0.5, routed=np.zeros((5, 4, 2), np.int32))
    back = Sample.from_json(s.to_json())
    assert back.tokens == s.tokens and np.array_equal(back.routed_experts, s.routed_experts)
    with pytest.raises(ValueError):
        Sample([1, 2], [1, 1], [0.0, 0.0], 0.0, 0)
    with pytest.raises(ValueError):
        Sample([1, 2, 3], [0, 1, 1], [0.0, 0.0, 0.0], 0.0, 0, routed_experts=np.zeros((3, 1, 1)))


def test_environments_reward_what_they_say():
    tok = ByteTokenizer()
    env = make_env("byte_target", tok, {"target": "a"})
    ep = env.new_episode(3)
    assert ep.prompt[0] == tok.bos_token_id
    r = ep.step([ord("a"), ord("a"), ord("b"), tok.eos_token_id])
    assert r.done and r.reward == 0.5
    env = make_env("tool_call", tok)
    ep = env.new_episode(0)
    first = ep.step([ord("x")])
    assert not first.done and b"<tool_result>" in bytes(first.observation)
    digit = bytes(first.observation).split(b">")[1][:1]
    assert ep.step(list(digit * 3) + [ord("z")]).reward == 0.75
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("chess", tok)
    with pytest.raises(ValueError, match="bad env_args"):
        make_env("byte_target", tok, {"nope": 1})


def test_cli_offload_and_fp32_head_flags_reach_the_config():
    from trainer_bridge.config import load_config
    from trainer_bridge.train import parse_args

    args = parse_args(["--preset", "tiny", "--optimizer-offload", "chunked", "--no-fp32-lm-head"])
    assert (args.optimizer_offload, args.fp32_lm_head) == ("chunked", False)
    cfg = load_config("tiny", None, ["optim.optimizer_offload=chunked", "model.lm_head_fp32=false"])
    assert cfg.optim.optimizer_offload == "chunked" and cfg.model.lm_head_fp32 is False
    with pytest.raises(SystemExit):
        parse_args(["--preset", "tiny", "--optimizer-offload", "disk"])


def test_accumulate_unsharded_override_values():
    """Its values survive a command-line override (YAML would read on/off as bools)."""
    from trainer_bridge.config import load_config

    for value in ("auto", "always", "never"):
        cfg = load_config("tiny", None, [f"model.accumulate_unsharded={value}"])
        assert cfg.model.accumulate_unsharded == value
    with pytest.raises(ValueError, match="accumulate_unsharded.*always"):
        load_config("tiny", None, ["model.accumulate_unsharded=on"])


def test_lm_head_gemm_values_and_what_auto_means():
    """model.lm_head_gemm: auto is tf32x3-logits on CUDA (TF32 tensor cores), ieee on a CPU;
    anything else is refused at load (build_policy hands it to the head:
    test_trainer_compute_copies)."""
    from trainer_bridge.config import load_config
    from trainer_bridge.policy import lm_head_gemm_for

    assert lm_head_gemm_for(torch.device("cuda", 0), "auto") == "tf32x3-logits"
    assert lm_head_gemm_for(torch.device("cpu"), "auto") == "ieee"
    assert lm_head_gemm_for(torch.device("cpu"), "tf32x3") == "tf32x3"
    assert load_config("tiny", None, ["model.lm_head_gemm=ieee"]).model.lm_head_gemm == "ieee"
    with pytest.raises(ValueError, match="lm_head_gemm.*tf32x3"):
        load_config("tiny", None, ["model.lm_head_gemm=tf32"])


def test_rollout_sampling_seeds_are_fixed_per_session_and_turn():
    """A step's rollouts are drawn with seeds of (run seed, session, turn), not in the order the
    server happens to receive them."""
    from trainer_bridge.rollout import sampling_seed

    seeds = {sampling_seed(s, f"step0-p{p}-g{g}", t)
             for s in (0, 1) for p in range(4) for g in range(8) for t in range(2)}
    assert len(seeds) == 2 * 4 * 8 * 2 and all(0 <= x < 2**63 for x in seeds)
    assert sampling_seed(0, "step0-p0-g0", 0) == sampling_seed(0, "step0-p0-g0", 0)


@pytest.mark.parametrize("mini_batches,graphs,routing,expected", [
    (1, False, True, False),   # on-policy: the training forward's logprobs and routing
    (1, False, False, False),
    (1, True, False, False),   # graphed, nothing to check: its own logprobs
    (1, True, True, True),     # graphs record no routing: a no-grad forward checks it
    (2, False, False, True),   # several optimizer steps a batch: the old logprobs first
    (2, True, True, True),
])
def test_the_policy_forwards_before_the_update_only_where_a_step_needs_it(
        mini_batches, graphs, routing, expected):
    from types import SimpleNamespace

    from trainer_bridge.config import load_config
    from trainer_bridge.trainer import Trainer

    trainer = SimpleNamespace(cfg=load_config("tiny", None, [f"loss.mini_batches={mini_batches}"]),
                              policy=SimpleNamespace(graphs=object() if graphs else None))
    trainer.on_policy = lambda: Trainer.on_policy(trainer)
    mb = SimpleNamespace(routing={0: None} if routing else None)
    assert Trainer.needs_reference_forward(trainer, mb) is expected


@pytest.mark.parametrize("override,key", [
    ("optim.lr=0", "optim.lr"), ("optim.lr=-0.1", "optim.lr"), ("optim.lr=.inf", "optim.lr"),
    ("optim.sink_lr=-1", "optim.sink_lr"), ("optim.warmup_steps=-3", "optim.warmup_steps"),
    ("optim.max_grad_norm=0", "optim.max_grad_norm"),
    ("optim.max_grad_norm=-1", "optim.max_grad_norm"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"), ("optim.betas=[1.5,0.9]", "optim.betas"),
    ("optim.betas=[0.9,1.0]", "optim.betas"), ("loss.clip_eps=-0.2", "loss.clip_eps"),
    ("loss.clip_eps_high=0.1", "loss.clip_eps_high"), ("loss.kl_coef=-1", "loss.kl_coef"),
    ("seed=-1", "seed"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.temperature=-1", "rollout.temperature"),
    # cross-field checks, before any server or model
    ("rollout.env=chess", "rollout.env"), ("rollout.env_args={nope: 1}", "rollout.env_args"),
    ("rollout.server_urls=[]", "rollout.server_urls"),
])
def test_config_refuses_out_of_range_values_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config("tiny", None, [override])


def test_config_cross_field_and_yaml_file_errors(tmp_path):
    with pytest.raises(ValueError, match="one_rank=copies.*optimizer_offload=chunked"):
        load_config("tiny", None, ["optim.optimizer_offload=chunked", "model.one_rank=copies"])
    for text, msg in [("optim: {lr: [1,\n", "not valid YAML"), ("steps: 3\nsteps: 4\n",
                      "not valid YAML"), ("- 1\n- 2\n", "top level must be a mapping")]:
        f = tmp_path / "c.yaml"
        f.write_text(text)
        with pytest.raises(ValueError, match=msg):
            load_config("tiny", str(f), [])
    # still accepted: no clipping, sink_lr = lr, an offline source ignores env
    cfg = load_config("tiny", None, ["optim.max_grad_norm=.inf", "optim.sink_lr=null",
                                     "rollout.source=offline", "rollout.offline_path=x",
                                     "rollout.env=chess"])
    assert cfg.optim.sink_lr is None and math.isinf(cfg.optim.max_grad_norm)


def test_telemetry_resume_keeps_earlier_rows_drops_torn_line_and_plots_all(tmp_path):
    import json

    from trainer_bridge.telemetry import Telemetry

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": float(s)}) for s in (0, 1, 2, 3)]
    path.write_text("\n".join(rows) + '\n{"step": 4, "lo')   # killed mid-row
    t = Telemetry(str(tmp_path), True, tensorboard=False)
    assert t.resume(2) == 3
    assert [r["step"] for r in t.rows] == [0, 1]            # the plots start from step 0
    t.log(2, {"loss": 2.5})
    t.log(3, {"loss": 3.5})
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in got] == [(0, 0.0), (1, 1.0), (2, 2.5), (3, 3.5)]
    assert [r["step"] for r in t.rows] == [0, 1, 2, 3]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    # the dry run's directory starts empty every time
    Telemetry(str(tmp_path), True, tensorboard=False, fresh=True)
    assert not path.exists()


def test_a_metrics_row_that_cannot_be_written_names_the_file(tmp_path):
    """Disk full while logging (metrics.jsonl on /dev/full, which answers every write with
    ENOSPC): an OSError that names the file (train.main prints it as one error line and exits
    1), not os.write's bare ENOSPC."""
    import errno
    import os

    from trainer_bridge.telemetry import Telemetry

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    t = Telemetry(str(tmp_path), True, tensorboard=False)
    os.symlink("/dev/full", t.path)
    with pytest.raises(OSError) as err:
        t.log(0, {"loss": 1.0})
    assert err.value.filename == t.path and err.value.errno == errno.ENOSPC

def test_resume_config_differences_list_the_keys_that_would_change():
    from trainer_bridge.config import config_differences, config_snapshot

    saved = config_snapshot(load_config("tiny", None, []))
    assert config_differences(saved, load_config("tiny", None, ["out_dir=x", "steps=40"])) == []
    diff = config_differences(saved, load_config("tiny", None, ["optim.lr=0.1",
                                                                 "optim.warmup_steps=2"]))
    assert diff == ["optim.lr: 0.005 -> 0.1", "optim.warmup_steps: 0 -> 2"]
    # a checkpoint saved before a key existed (or with a key since dropped) still resumes
    older = {k: v for k, v in saved.items() if k != "model.serving_numerics"}
    assert config_differences({**older, "loss.dropped_key": 1},
                              load_config("tiny", None, [])) == []


def _fake_checkpoint(root, step, world_size=1, **extra):
    from trainer_bridge.config import config_snapshot

    d = root / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"")
    torch.save({"step": step, "world_size": world_size,
                "config": config_snapshot(load_config("tiny", None, [])), **extra},
               d / "trainer_state.pt")
    return d


def test_checkpoint_read_errors_name_the_file_and_the_older_checkpoint(tmp_path):
    from trainer_bridge.checkpoint import (CheckpointLoadError, check_world_size,
                                           read_trainer_state)

    older, newer = _fake_checkpoint(tmp_path, 2), _fake_checkpoint(tmp_path, 4)
    (newer / "trainer_state.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointLoadError) as e:
        read_trainer_state(str(newer))
    msg = str(e.value)
    assert str(newer / "trainer_state.pt") in msg and f"--resume-from {older}" in msg
    with pytest.raises(CheckpointLoadError, match="no older complete checkpoint"):
        read_trainer_state(str(_fake_checkpoint(tmp_path / "b", 1, bad=1).parent / "nope"))
    state = read_trainer_state(str(older))
    check_world_size(str(older), state, 1)
    with pytest.raises(CheckpointLoadError, match="saved by 1 rank.*this run has 2"):
        check_world_size(str(older), state, 2)
    # a checkpoint from before world_size was recorded: its RNG files say
    with pytest.raises(CheckpointLoadError, match="saved by 2 rank"):
        for r in (0, 1):
            (older / f"rng_rank{r}.pt").write_bytes(b"")
        check_world_size(str(older), {"step": 2}, 1)


class _Episode:
    prompt = [1, 2, 3]

    def step(self, out):
        from types import SimpleNamespace

        return SimpleNamespace(done=True, reward=1.0, observation=[])


class _OneTurnEnv:
    name, max_turns = "one-turn", 1

    def new_episode(self, prompt_index):
        return _Episode()


class _VersionedRouter:
    """Answers every turn from engine e0 with the weight_version ``versions`` gives the
    session (default ``version``)."""

    def __init__(self, version):
        self.version, self.versions = version, {}

    def generate(self, session_id, payload, expected_tokens=0):
        return {"output_ids": [7, 8], "meta_info": {
            "output_token_logprobs": [[-1.0, 7], [-2.0, 8]], "route": ["http://e0", 0],
            "weight_version": self.versions.get(session_id, self.version)}}

    def end_session(self, session_id):
        pass


def test_rollouts_check_every_responses_weight_version():
    """Before any push the first response's version (the server's own) is expected from then
    on; after a push the pushed one; a response from other weights fails the step's collect
    naming the engine, the served and the expected version."""
    from trainer_bridge.config import RolloutConfig
    from trainer_bridge.rollout import ServerRolloutSource, WeightVersionMismatch

    router = _VersionedRouter("default")
    src = ServerRolloutSource(router, _OneTurnEnv(), RolloutConfig(prompts_per_step=1,
                              group_size=3, max_new_tokens=2, concurrency=2), False)
    try:
        assert len(src.collect(0)) == 3 and src.expected_version == "default"
        router.versions["step1-p1-g2"] = "step-7.partial"
        with pytest.raises(WeightVersionMismatch) as e:
            src.collect(1)
        assert (e.value.engine, e.value.served, e.value.expected) == (
            "http://e0 dp_rank 0", "step-7.partial", "default")
        assert "engine http://e0 dp_rank 0 served weight_version 'step-7.partial'" in str(e.value)
        src.expected_version, router.version, router.versions = "step-7", "step-7", {}
        assert len(src.collect(2)) == 3
        router.version = "default"  # restarted on its base weights
        with pytest.raises(WeightVersionMismatch, match="'default', expected 'step-7'"):
            src.collect(3)
    finally:
        src.close()


def test_r3_routing_is_checked_where_rank_0_collects():
    from trainer_bridge.rollout import check_routing_present

    good = np.zeros((5, 4, 2), np.int32)
    check_routing_present([sample(routed=good)], [0, 3], top_k=2)
    check_routing_present([sample()], [], top_k=2)  # nothing routed: nothing to check
    with pytest.raises(ValueError, match="sample 1 .* no routed experts"):
        check_routing_present([sample(routed=good), sample()], [0, 3], top_k=2)
    with pytest.raises(ValueError, match="shape \\(5, 4, 2\\)"):
        check_routing_present([sample(routed=good)], [4], top_k=2)  # layer 4 of 4
    with pytest.raises(ValueError, match="shape"):
        check_routing_present([sample(routed=good)], [0], top_k=3)
    bad = good.copy()
    bad[2, 3] = -1
    with pytest.raises(ValueError, match="-1 rows in layer\\(s\\) \\[3\\]"):
        check_routing_present([sample(routed=bad)], [0, 3], top_k=2)


ONE_RANK_FAILS = """
import os, sys
import torch.distributed as dist
import trainer_bridge.trainer as t
from trainer_bridge import train
real = t.pack
def pack(*a, **k):
    if os.environ.get("FAIL_RANK_1") and dist.get_rank() == 1:
        raise ValueError("injected: rank 1 alone fails in pack")
    return real(*a, **k)
t.pack = pack
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["rank_1_alone_raises", "sample_without_routing"])
def test_an_error_on_one_rank_ends_a_two_rank_job_with_its_message(tmp_path, case):
    """2 FSDP ranks (gloo, torchrun). An error raised on rank 1 alone (in pack) while rank 0
    waits in a collective ends the job with that error, never a barrier-in-close hang; a
    sample without the server's routing (R3) is refused where rank 0 collects the step, so
    both ranks fail with the reason."""
    import json
    import os
    import sys
    import time

    from jobs import run_job

    from sglang_dsv41.ports import free_port

    rng = np.random.default_rng(0)
    samples = []
    for i in range(4):
        n = 12
        ids = np.stack([(np.arange(2) + i + j) % 8 for j in range(8)])  # [layers, top_k]
        ids = np.broadcast_to(ids, (n - 1, 8, 2)).astype(np.int32)
        broken = case == "sample_without_routing" and i == 1
        s = Sample(rng.integers(0, 256, n).tolist(), [0] * 8 + [1] * 4,
                   [0.0] * 8 + [-1.0] * 4, float(i % 2), 0,
                   routed_experts=None if broken else ids,
                   routed_weights=None if broken else np.full(ids.shape, 0.5, np.float32))
        samples.append(s.to_json())
    record = tmp_path / "rollouts.jsonl"
    record.write_text(json.dumps({"step": 0, "samples": samples}) + "\n")
    script = tmp_path / "one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               **({"FAIL_RANK_1": "1"} if case == "rank_1_alone_raises" else {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(script), "--preset", "tiny",
           "rollout.source=offline", f"rollout.offline_path={record}",
           f"out_dir={tmp_path / 'out'}", "steps=1", "plots=false", "tensorboard=false",
           "loss.mini_batches=1"]
    t0 = time.monotonic()
    rc, out = run_job(cmd, 150, env)
    assert rc != 0, out[-3000:]
    if case == "rank_1_alone_raises":
        assert "injected: rank 1 alone fails in pack" in out, out[-3000:]
    else:
        assert "sample 1" in out and "no routed experts" in out, out[-3000:]
        assert "[rank0]" in out and "[rank1]" in out  # both ranks raise the reason
    print(f"{case}: ended after {time.monotonic() - t0:.1f}s")


def _wait_forever(queue) -> None:
    import time

    time.sleep(3600)


def test_a_failed_spawned_run_kills_its_workers_at_once():
    """run_spawned's workers of a run that timed out (or was interrupted) may wait in a
    collective for good: they are killed at once, not joined first (pytest-timeout cut the
    join short and left them running)."""
    import time

    import psutil

    from trainer_bridge.dist import run_spawned

    before = {c.pid for c in psutil.Process().children()}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 1 s"):
        run_spawned(_wait_forever, [(), ()], timeout=1, join_timeout=30)
    assert time.monotonic() - t0 < 20  # a join first would wait 30 s a worker
    left = [c for c in psutil.Process().children() if c.pid not in before and c.is_running()
            and c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in
            " ".join(c.cmdline())]
    assert left == [], left


class TwoEngineRouter(SessionRouter):
    """The router's view a push reads: engine ``live`` in rotation, ``dead`` out of it."""

    def __init__(self, live: str, dead: str):
        self.live, self.dead, self.updated = live, dead, []
        self._cond, self._paused = threading.Condition(), False

    def engine_urls(self):
        return [self.live]

    def all_engine_urls(self):
        return [self.live, self.dead]

    def drain(self, timeout):
        return True

    def weights_updated(self, version, urls):
        self.updated.append((version, urls))

    def generate(self, session_id, payload, expected_tokens=0):
        raise NotImplementedError  # a push sends no turns

    route_of = end_session = generate


def checksum_engine(checksums):
    """An engine on loopback that takes every tensor update and reports the next of
    ``checksums`` on each GET /engram_checksum (an engine whose Engram table an update
    changed: none of ours does, so the engine is a stand-in)."""
    from fastapi import FastAPI

    app, answers = FastAPI(), iter(checksums)
    app.get("/health")(lambda: {})
    app.get("/engram_checksum")(lambda: {"result": next(answers)})
    app.post("/update_weights_from_tensor")(lambda: {"success": True})
    return app


def test_a_dead_engine_failing_after_the_push_stays_out_and_a_live_one_fails_it():
    """A restarted engine (dead to the router) that takes the push but then reports another
    Engram checksum is left out of rotation; the same on a live engine fails the push."""
    from engine_server_fakes import serve
    from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM
    from sglang_dsv41.model.dsv4.presets import get_preset
    from trainer_bridge.weight_sync import WeightSyncError, WeightSyncer

    with torch.device("meta"):
        model = DSV4ForCausalLM(get_preset("tiny"))
    state = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in model.state_dict().items()}
    servers = []
    try:
        servers.append(serve(checksum_engine(["a", "a", "a", "a"])))
        servers.append(serve(checksum_engine(["a", "b", "a", "b"])))
        (_, good), (_, bad) = servers
        router = TwoEngineRouter(live=good, dead=bad)
        syncer = WeightSyncer(router, served_dtype="bfloat16")
        out = syncer._push(model, state, "step-1")
        assert out["engines"] == [good] and list(out["skipped_engines"]) == [bad]
        assert "Engram checksum changed" in out["skipped_engines"][bad]
        assert router.updated == [("step-1", [good])]
        router.live, router.dead = bad, good  # the same engine in rotation: the push fails
        with pytest.raises(WeightSyncError, match="Engram checksum changed"):
            syncer._push(model, state, "step-2")
        syncer.close()
    finally:
        for server, _ in servers:
            server.should_exit = True
