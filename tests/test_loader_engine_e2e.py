"""Loader plugins end to end through the embedded server (tp=2, tiny checkpoint on CPU):
a full load (shared Engram) is the reference; it is killed with SIGKILL, and a dummy start
(private Engram) reclaims its segments, is brought to the same greedy outputs and logprobs by
/update_weights_from_tensor, refuses bad updates with a 400 naming the tensor, takes a
distributed update from a real trainer process (this one), overwrites Engram only when forced,
and leaves nothing in /dev/shm."""

from __future__ import annotations

import base64
import glob
import os
import signal
import threading
import time

import httpx
import pytest
import torch
from loader_fixtures import free_port, tiny_cfg, write_checkpoint
from safetensors.torch import save

from sglang_dsv41.loader.weight_sync_group import init_weight_sync_group, send_weights
from sglang_dsv41.model.model import is_engram_table
from sglang_dsv41.server_process import ServerProcess

pytestmark = [pytest.mark.timeout(240)]
TABLE = "model.layers.1.engram.table.weight"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [200, 3]]


def generate_all(http) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in PROMPTS:
        r = http.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 6,
                                                             "temperature": 0.0,
                                                             "ignore_eos": True}})
        assert r.status_code == 200, r.text
        body = r.json()
        out.append((body["output_ids"], [lp for lp, _, _ in
                                         body["meta_info"]["output_token_logprobs"]]))
    return out


def tensor_body(named, **extra) -> dict:
    raw = save({n: t.contiguous() for n, t in named})
    return {"serialized_named_tensors": base64.b64encode(raw).decode(), **extra}


def segments(shm) -> list[str]:
    return sorted(f for f in os.listdir(shm) if ".seg-" in f)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader_e2e")
    ckpt, shm = str(root / "ckpt"), str(root / "shm")
    os.makedirs(shm)
    tensors = write_checkpoint(ckpt, tiny_cfg(), "bf16")
    return ckpt, shm, tensors, {"SGLANG_DSV41_SHM_DIR": shm}


def test_dummy_start_update_equals_full_load(setup):
    ckpt, shm, tensors, env = setup
    base = ["--model-path", ckpt, "--tp-size", "2", "--stall-timeout", "60"]
    semaphores_before = set(glob.glob("/dev/shm/sem.mp-*"))
    with ServerProcess([*base, "--engram-layout", "shared"], env=env, startup_timeout=150) as ref:
        http = httpx.Client(base_url=ref.url, timeout=60)
        want = generate_all(http)
        checksums = http.get("/engram_checksum").json()["result"]
        assert set(checksums) == {TABLE}
        files = os.listdir(shm)
        assert segments(shm) and len(segments(shm)) == 1  # one node copy for both ranks
        assert sum(".lease-" in f for f in files) == 2
        log = ref.log_text()
        assert "Engram table " + TABLE in log and "layout=shared" in log
        os.killpg(ref.proc.pid, signal.SIGKILL)
        ref.proc.wait(10)
    assert segments(shm), "a SIGKILLed server leaves its segment behind"
    # SIGKILL of the whole group also kills multiprocessing's resource tracker, which would
    # have unlinked the killed server's queue semaphores: remove them so the test leaves none.
    for path in set(glob.glob("/dev/shm/sem.mp-*")) - semaphores_before:
        os.unlink(path)

    with ServerProcess([*base, "--engram-layout", "private", "--load-format", "dummy"], env=env,
                       startup_timeout=150) as srv:
        http = httpx.Client(base_url=srv.url, timeout=120)
        assert segments(shm) == []  # reclaimed at start; private keeps none
        assert generate_all(http) != want
        assert http.get("/engram_checksum").json()["result"] == checksums  # from the checkpoint
        update = [(n, t.float()) for n, t in tensors.items() if not is_engram_table(n)]
        half = len(update) // 2
        for part, last in ((update[:half], False), (update[half:], True)):
            r = http.post("/update_weights_from_tensor",
                          json=tensor_body(part, flush_cache=last, weight_version="w1"))
            assert r.status_code == 200, r.text
        assert http.get("/get_model_info").json()["weight_version"] == "w1"
        assert generate_all(http) == want  # ids and logprobs, exactly
        assert http.get("/engram_checksum").json()["result"] == checksums

        name = "model.layers.0.self_attn.q_proj.weight"
        good = dict(update)[name]
        before = http.get("/get_weights_by_name", params={"name": name}).json()
        for bad in ([("model.nope.weight", good)], [(name, good[:-1])],
                    [(name, good.to(torch.bfloat16))], [(TABLE, torch.zeros(4096, 32))]):
            r = http.post("/update_weights_from_tensor", json=tensor_body(bad))
            assert r.status_code == 400 and bad[0][0] in r.text, r.text
        assert http.get("/get_weights_by_name", params={"name": name}).json() == before
        assert generate_all(http) == want

        _distributed_updates(http, update, want)
        forced = tensor_body([(TABLE, torch.randn(4096, 32).to(torch.bfloat16))],
                             allow_engram_update=True)  # the per-request override
        r = http.post("/update_weights_from_tensor", json=forced)
        assert r.status_code == 200, r.text
        assert http.get("/engram_checksum").json()["result"][TABLE] != checksums[TABLE]
    assert os.listdir(shm) == []  # a clean stop removes everything


def _post_in_thread(http, path, body, box):
    def run():
        box["response"] = http.post(path, json=body)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _distributed_updates(http, update, want):
    port = free_port()
    box: dict = {}
    t = _post_in_thread(http, "/init_weights_update_group",
                        {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                         "world_size": 3, "group_name": "g", "backend": "gloo"}, box)
    group = init_weight_sync_group("127.0.0.1", port, 0, 3, "g", "gloo", timeout_s=60)
    t.join(60)
    assert box["response"].status_code == 200, box["response"].text
    try:
        def push(named):
            meta = {"names": [n for n, _ in named], "dtypes": [str(t.dtype)[6:] for _, t in named],
                    "shapes": [list(t.shape) for _, t in named], "group_name": "g"}
            box.clear()
            th = _post_in_thread(http, "/update_weights_from_distributed", meta, box)
            sent = send_weights(group, named)
            th.join(60)
            return sent, box["response"]

        head = "lm_head.weight"
        original = dict(update)[head]
        sent, r = push([(head, torch.zeros_like(original))])
        assert sent and r.status_code == 200, r.text
        values = http.get("/get_weights_by_name", params={"name": head}).json()
        assert set(values["result"]["values"]) == {0.0}
        sent, r = push([(head, original[:1])])  # wrong shape: refused before anything is sent
        assert not sent and r.status_code == 400 and head in r.text
        sent, r = push(update)  # the whole model again
        assert sent and r.status_code == 200, r.text
        time.sleep(0.1)
        assert generate_all(http) == want
    finally:
        group.close()
