"""Push the trainer's weights to every engine after a step. transport "tensor":
/update_weights_from_tensor with base64 safetensors buckets; "distributed": a process group
with every scheduler rank (/init_weights_update_group once, then per sync
/update_weights_from_distributed while rank 0 broadcasts the buckets). Names are SGLang 0.5.23's
flat checkpoint names (the model's own), so the same push drives a real SGLang server. The frozen
tables (Engram ``engram.embed.*``, ``tid2eid``) are never sent, and each engine's Engram checksum
(GET /engram_checksum) must be unchanged by the update.

All ranks call ``sync`` (gathering the full state dict is a collective); rank 0 talks HTTP and
broadcasts the outcome so every rank raises the same error.

Versions: only a complete update labels an engine with the push's ``version``. The tensor
transport's buckets before the last carry ``partial_version(version)`` (each bucket relabels
the engine), so an engine a push left half-updated reports a version that differs from the
trainer's (the trainer's check of every rollout's weight_version catches it); the distributed
transport is one request per engine, applied and labelled only once every tensor arrived.
A push goes to the router's live engines and to its dead ones that answer /health (a restarted
engine is dead to the router until a push brings it back to the current weights); a dead
engine's failed update is logged and leaves it dead, a live one's fails the sync.
"""

from __future__ import annotations

import base64
import logging
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

log = logging.getLogger("trainer_bridge")


class WeightSyncError(RuntimeError):
    pass


def partial_version(version: str) -> str:
    """The label of an engine a push has begun but not finished (no trailing number: None
    would make the engine bump one)."""
    return f"{version}.partial"


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
        # The version of the last complete push (every rank): what the engines must serve.
        self.version: str | None = None

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
        self.version = version
        return outcome

    def served_versions(self) -> dict[str, str]:
        """Rank 0: every engine's weight_version (GET /get_weight_version), live or dead to the
        router; an engine that does not answer is left out (the router deals with it)."""
        assert self.router is not None and self.client is not None
        out = {}
        for url in self.router.all_engine_urls():
            try:
                out[url] = str(self._get(url, "/get_weight_version")["weight_version"])
            except (httpx.HTTPError, WeightSyncError, KeyError, ValueError):
                continue
        return out

    # ---- rank 0 ---------------------------------------------------------------------------
    def _push(self, model, state: dict[str, torch.Tensor], version: str) -> dict[str, Any]:
        assert self.router is not None and self.client is not None
        live = self.router.engine_urls()
        named = pushed_tensors(state)
        skipped: dict[str, str] = {}
        with self.router.paused():
            # Dead engines that answer again (a restarted one) take the push too: the router
            # revives an engine only once it serves the pushed version.
            urls = live + [u for u in self.router.all_engine_urls()
                           if u not in live and self._answers(u)]
            if not urls:
                raise WeightSyncError("no engine to update: every engine is dead and none "
                                      "answers /health")
            before = {u: self._attempt(u, live, skipped, self._get, u, "/engram_checksum")
                      for u in urls}
            urls = self._taking(urls, skipped)
            dtypes = self._served_dtypes(model, urls[0])
            plan = _bucket_plan(named, dtypes, self.bucket_bytes)
            num_bytes = 0
            if self.transport == "distributed":
                served = self.served_versions() if self._groups else {}
                for u in [u for u in urls if u in self._groups]:
                    if u not in live or served.get(u) != self.version:
                        # dead to the router, or not serving our last push (a restarted
                        # engine): its side of our process group may be gone, make a new one
                        group, _ = self._groups.pop(u)
                        group.close()
                for u in urls:
                    num_bytes += self._attempt(u, live, skipped, self._push_distributed,
                                               u, named, dtypes, version) or 0
            # One bucket at a time: only a bucket's casts exist at once besides the state.
            for i, indices in enumerate(plan if self.transport == "tensor" else []):
                bucket = storable_state({named[j][0]: named[j][1] for j in indices},
                                        lambda n, _: dtypes[n])
                payload = base64.b64encode(save(bucket)).decode()
                num_bytes += len(payload)
                last = i == len(plan) - 1
                # Only the last bucket labels the engine with the version: an engine a failed
                # push left half-updated never claims it.
                body = {"serialized_named_tensors": payload, "flush_cache": last,
                        "weight_version": version if last else partial_version(version)}
                for u in [u for u in urls if u not in skipped]:
                    self._attempt(u, live, skipped, self._post,
                                  u, "/update_weights_from_tensor", body)
            after = {u: self._attempt(u, live, skipped, self._unchanged_checksum, u, before[u])
                     for u in self._taking(urls, skipped)}
            urls = self._taking(urls, skipped)
        self.router.weights_updated(version, urls)
        out = {"num_tensors": len(named), "num_buckets": len(plan), "payload_bytes": num_bytes,
               "engram_checksum": _checksums(after[urls[0]]), "engines": urls}
        if skipped:
            out["skipped_engines"] = skipped
        return out

    def _answers(self, url: str) -> bool:
        try:
            return self.client.get(url + "/health", timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _attempt(self, url: str, live: list[str], skipped: dict[str, str], fn, *args):
        """``fn(*args)`` for one engine, its result: a live engine's failure fails the push; a
        dead engine's (the router has it out of rotation) is logged, the engine left out of
        the rest (None)."""
        try:
            return fn(*args)
        except Exception as e:
            if url in live:
                raise
            skipped[url] = f"{type(e).__name__}: {e}"
            log.warning("weight push to %s (dead to the router) failed, it stays out of "
                        "rotation: %s", url, skipped[url])
            return None

    @staticmethod
    def _taking(urls: list[str], skipped: dict[str, str]) -> list[str]:
        """The engines still taking the push; none left fails it."""
        urls = [u for u in urls if u not in skipped]
        if not urls:
            raise WeightSyncError(f"no engine took the update: {skipped}")
        return urls

    def _unchanged_checksum(self, url: str, before: dict[str, Any]) -> dict[str, Any]:
        after = self._get(url, "/engram_checksum")
        if _checksums(before) != _checksums(after):
            raise WeightSyncError(f"{url}: Engram checksum changed by the weight update: "
                                  f"{_checksums(before)} -> {_checksums(after)}")
        return after

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
