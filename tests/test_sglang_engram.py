"""The Engram patches (dummy load + placement) against boundary objects: a model standing in
for an SGLang model (named_parameters and load_weights), loaders standing in for SGLang's
DummyModelLoader.load_model and DefaultModelLoader.load_weights_and_postprocess."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_dsv41.sglang_backend.patches import engram
from sglang_dsv41.sglang_backend.state import STATE, RankInfo


@pytest.fixture(autouse=True)
def _reset_state():
    yield
    STATE.rank = RankInfo()


class SGLangModelBoundary(torch.nn.Module):
    """Stands in for an SGLang model: named_parameters() and load_weights(iterable)."""

    def __init__(self, inner, engram_rows=None):
        super().__init__()
        self.inner = inner
        if engram_rows is not None:  # a private-layout model holds only its row shard
            for name, p in list(inner.named_parameters()):
                if ".engram.table." in name:
                    owner = inner.get_submodule(name.rsplit(".", 1)[0])
                    owner.weight = torch.nn.Parameter(p.detach()[:engram_rows].clone(),
                                                      requires_grad=False)
        self.loaded = []

    def named_parameters(self, *a, **kw):
        return self.inner.named_parameters(*a, **kw)

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
            self.loaded.append(name)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from sglang_dsv41.loader.checkpoint import model_tensors, save_checkpoint
    from sglang_dsv41.model import build_model, get_preset

    cfg = get_preset("tiny")
    real = build_model(cfg, seed=0)
    path = save_checkpoint(model_tensors(real), str(tmp_path_factory.mktemp("ckpt")), cfg)
    return path, cfg, dict(real.named_parameters())


def _dummy_model(cfg, engram_rows=None):
    from sglang_dsv41.model import build_model

    inner = build_model(cfg, seed=None)
    with torch.no_grad():
        for p in inner.parameters():
            p.uniform_(-1e-3, 1e-3)  # what SGLang's dummy fill does
    return SGLangModelBoundary(inner, engram_rows)


def test_dummy_load_streams_engram_bit_exact(tiny_checkpoint, monkeypatch):
    path, cfg, real = tiny_checkpoint
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_CHECKPOINT", path)
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_LAYOUT", "shared")
    model = _dummy_model(cfg)
    load = engram.make_dummy_load_engram(lambda self, *, model_config, device_config: model)
    out = load(None, model_config=types.SimpleNamespace(model_path="/nonexistent"),
               device_config=None)
    engram_names = [n for n in real if ".engram.table." in n]
    assert engram_names and sorted(out.loaded) == sorted(engram_names)
    got = dict(model.named_parameters())
    for n in real:
        if n in engram_names:
            assert torch.equal(got[n], real[n]), n
        else:
            assert got[n].abs().max() <= 1e-3, n  # everything else stays dummy
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_DUMMY_LOAD", "0")
    assert load(None, model_config=None, device_config=None).loaded == out.loaded  # no reload


def test_private_layout_loads_only_the_rank_shard(tiny_checkpoint, monkeypatch):
    from sglang_dsv41.loader.engram_codec import shard_range

    path, cfg, real = tiny_checkpoint
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_LAYOUT", "private")
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_CHECKPOINT", path)
    STATE.rank = RankInfo(tp_rank=1, tp_size=2)
    lo, hi = shard_range(cfg.engram_num_rows, 1, 2)
    model = _dummy_model(cfg, engram_rows=hi - lo)
    engram.make_dummy_load_engram(lambda self, **kw: model)(None, model_config=None,
                                                             device_config=None)
    for n, p in model.named_parameters():
        if ".engram.table." in n:
            assert torch.equal(p, real[n][lo:hi]), n
    # the regular load path with the same placement: full tables in, rank shards out
    seen = {}
    place = engram.make_engram_placement(lambda m, w, dev: seen.update(dict(w)))
    place(None, iter(real.items()), "cpu")
    assert all(torch.equal(seen[n], real[n][lo:hi]) if ".engram.table." in n
               else seen[n] is real[n] for n in real)
    too_big = _dummy_model(cfg)  # holds the full table: the shard cannot fill it
    with pytest.raises(ValueError, match="engram.table.weight.*rank 1"):
        engram.make_dummy_load_engram(lambda self, **kw: too_big)(None, model_config=None,
                                                                  device_config=None)


def test_dummy_load_refuses_a_checkpoint_without_engram(tiny_checkpoint, tmp_path, monkeypatch):
    from sglang_dsv41.loader.checkpoint import iter_checkpoint_tensors, save_checkpoint

    path, cfg, real = tiny_checkpoint
    no_engram = save_checkpoint({n: t for n, t in iter_checkpoint_tensors(path)
                                 if ".engram.table." not in n}, str(tmp_path / "ckpt"), cfg)
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_CHECKPOINT", no_engram)
    model = _dummy_model(cfg)
    with pytest.raises(ValueError, match="has Engram tables .* holds none"):
        engram.make_dummy_load_engram(lambda self, **kw: model)(None, model_config=None,
                                                                device_config=None)


def test_scale_rows_follow_128_row_blocks_when_rows_are_not_a_multiple():
    import torch

    from sglang_dsv41.loader.engram_codec import shard_range
    from sglang_dsv41.sglang_backend.patches.engram import engram_row_slice

    table = "model.layers.1.engram.table"
    headers = {f"{table}.weight": (torch.float8_e4m3fn, [1000, 256]),
               f"{table}.weight_scale_inv": (torch.float32, [8, 2])}
    lo, hi = shard_range(1000, 0, 2)
    assert engram_row_slice(f"{table}.weight_scale_inv", headers, 0, 2) == (lo // 128,
                                                                              -(-hi // 128))
    headers[f"{table}.weight_scale_inv"] = (torch.float32, [9, 2])
    with pytest.raises(ValueError, match="scale rows"):
        engram_row_slice(f"{table}.weight_scale_inv", headers, 0, 2)
