"""Push the trainer's weights to every engine after a step. transport "tensor":
/update_weights_from_tensor with base64 safetensors buckets; "distributed": a process group
with every scheduler rank (/init_weights_update_group once, then per sync
/update_weights_from_distributed while rank 0 broadcasts the buckets). Names are SGLang 0.5.23's
flat checkpoint names (the model's own), so the same push drives a real SGLang server. The frozen
tables (Engram ``engram.embed.*``, ``tid2eid``) are never sent, and each engine's Engram checksum
(GET /engram_checksum) must be unchanged by the update.

All ranks call ``sync`` (gathering the full state dict is a collective); rank 0 talks HTTP and
broadcasts the outcome so every rank raises the same error.
"""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch
from safetensors.torch import save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from sglang_dsv41.loader.serving import cast_for_serving_
from sglang_dsv41.loader.weight_sync_group import parse_dtype, plan_buckets
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM
from sglang_dsv41.model.dsv4.names import is_frozen_table, per_expert_state, storable_state
from sglang_dsv41.ports import free_port
from sglang_dsv41.router import SessionRouter

from .dist import broadcast_object
from .parallelize import server_param_name


class WeightSyncError(RuntimeError):
    pass


def served_dtypes(model: DSV4ForCausalLM, served_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Each tensor's dtype in a server that loaded the model in ``served_dtype``: the loader's
    own rule (sinks, norms, mHC, compressor ape fp32; buffers such as the routing bias as
    built)."""
    with torch.device("meta"):
        meta = DSV4ForCausalLM(model.cfg)
    cast_for_serving_(meta, served_dtype)
    return {n: t.dtype for n, t in meta.state_dict().items()}


def pushed_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The trainer's full state dict -> (SGLang name, tensor) to send: no frozen table, the
    routed experts per expert."""
    named = per_expert_state({server_param_name(n): t for n, t in state.items()})
    return [(n, t) for n, t in named.items() if not is_frozen_table(n)]


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded state dict on CPU on rank 0, {} elsewhere."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


class WeightSyncer:
    def __init__(self, router: SessionRouter | None, *, api_key: str | None = None,
                 bucket_bytes: int = 256 << 20, timeout: float = 600.0,
                 served_dtype: str = "auto", transport: str = "tensor",
                 master_address: str = "127.0.0.1"):
        if transport not in ("tensor", "distributed"):
            raise ValueError(f"weight sync transport {transport!r}: tensor or distributed")
        self.router, self.bucket_bytes, self.served_dtype = router, bucket_bytes, served_dtype
        self.transport, self.master_address = transport, master_address
        self._groups: dict[str, Any] = {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers) if router else None
        self._dtypes: dict[str, torch.dtype] | None = None

    def sync(self, model: DSV4ForCausalLM, version: str, is_primary: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        state = full_state_dict(model)
        outcome: dict[str, Any] = {}
        if is_primary:
            try:
                outcome = self._push(model, state, version)
            except Exception as e:  # every rank must learn about it, then raise the same error
                outcome = {"error": f"{type(e).__name__}: {e}"}
        outcome = broadcast_object(outcome)
        if "error" in outcome:
            raise WeightSyncError(outcome["error"])
        outcome["weight_sync_s"] = time.perf_counter() - t0
        return outcome

    # ---- rank 0 ---------------------------------------------------------------------------
    def _push(self, model, state: dict[str, torch.Tensor], version: str) -> dict[str, Any]:
        assert self.router is not None and self.client is not None
        urls = self.router.engine_urls()
        if not urls:
            raise WeightSyncError("no live engine to update")
        named = pushed_tensors(state)
        with self.router.paused():
            before = {u: self._get(u, "/engram_checksum") for u in urls}
            dtypes = self._served_dtypes(model, urls[0])
            plan = _bucket_plan(named, dtypes, self.bucket_bytes)
            num_bytes = 0
            if self.transport == "distributed":
                for u in urls:
                    num_bytes += self._push_distributed(u, named, dtypes, version)
            # One bucket at a time: only a bucket's casts exist at once besides the state.
            for i, indices in enumerate(plan if self.transport == "tensor" else []):
                bucket = storable_state({named[j][0]: named[j][1] for j in indices},
                                        lambda n, _: dtypes[n])
                payload = base64.b64encode(save(bucket)).decode()
                num_bytes += len(payload)
                body = {"serialized_named_tensors": payload, "weight_version": version,
                        "flush_cache": i == len(plan) - 1}
                for u in urls:
                    self._post(u, "/update_weights_from_tensor", body)
            after = {u: self._get(u, "/engram_checksum") for u in urls}
        for u in urls:
            if _checksums(before[u]) != _checksums(after[u]):
                raise WeightSyncError(f"{u}: Engram checksum changed by the weight update: "
                                      f"{_checksums(before[u])} -> {_checksums(after[u])}")
        return {"num_tensors": len(named), "num_buckets": len(plan), "payload_bytes": num_bytes,
                "engram_checksum": _checksums(after[urls[0]]), "engines": urls}

    def _push_distributed(self, url: str, named: list[tuple[str, torch.Tensor]],
                          dtypes: dict[str, torch.dtype], version: str) -> int:
        from sglang_dsv41.loader.weight_sync_group import send_weights

        group, name = self._groups.get(url) or self._init_group(url)
        wire = [dtypes[n] for n, _ in named]
        body = {"names": [n for n, _ in named],
                "dtypes": [str(d).replace("torch.", "") for d in wire],
                "shapes": [list(t.shape) for _, t in named], "group_name": name,
                "flush_cache": True, "weight_version": version}
        # The server joins the broadcasts while its HTTP call is in flight.
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(self._post, url, "/update_weights_from_distributed", body)
            sent = send_weights(group, named, self.bucket_bytes, wire)
            reply.result()
        if not sent:
            raise WeightSyncError(f"{url} refused the distributed update")
        return sum(t.numel() * d.itemsize for (_, t), d in zip(named, wire))

    def _init_group(self, url: str):
        from sglang_dsv41.loader.weight_sync_group import init_weight_sync_group

        tp = int(self._get(url, "/get_server_info")["tp_size"])
        port = free_port()
        name = f"trainer-weights-{port}"
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        body = {"master_address": self.master_address, "master_port": port, "rank_offset": 1,
                "world_size": 1 + tp, "group_name": name, "backend": backend}
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(self._post, url, "/init_weights_update_group", body)
            group = init_weight_sync_group(self.master_address, port, 0, 1 + tp, name, backend)
            reply.result()
        self._groups[url] = (group, name)
        return self._groups[url]

    def _served_dtypes(self, model, url: str) -> dict[str, torch.dtype]:
        if self._dtypes is None:
            name = self.served_dtype
            if name == "auto":
                info = self._get(url, "/get_model_info")
                name = info.get("dtype") or self._get(url, "/get_server_info").get("dtype")
                name = name or "float32"
            try:
                dtype = parse_dtype(name)
            except ValueError as e:
                raise WeightSyncError(f"served dtype: {e}") from None
            self._dtypes = served_dtypes(model, dtype)
        return self._dtypes

    def _get(self, url: str, path: str) -> dict[str, Any]:
        r = self.client.get(url + path)
        if r.status_code != 200:
            raise WeightSyncError(f"GET {url}{path} answered {r.status_code}: {r.text}")
        return r.json()

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.client.post(url + path, json=body)
        if r.status_code != 200:
            raise WeightSyncError(f"POST {url}{path} answered {r.status_code}: {r.text}")
        return r.json()

    def close(self) -> None:
        for group, _ in self._groups.values():
            group.close()
        if self.client is not None:
            self.client.close()


def _checksums(reply: dict[str, Any]) -> Any:
    return reply.get("result", reply)


def _bucket_plan(named: list[tuple[str, torch.Tensor]], dtypes: dict[str, torch.dtype],
                 bucket_bytes: int) -> list[list[int]]:
    """Indices into ``named`` per bucket, sized by the served dtypes (plan_buckets' grouping)."""
    missing = [name for name, _ in named if name not in dtypes]
    if missing:
        raise WeightSyncError(f"trainer tensor {missing[0]} has no counterpart in the served model")
    return plan_buckets([dtypes[name] for name, _ in named], [list(t.shape) for _, t in named],
                        bucket_bytes)
