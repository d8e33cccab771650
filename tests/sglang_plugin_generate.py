"""The /generate case of sglang_plugin_cases.py: SGLang 0.5.23's own request path in one process,
with the GPU schedulers as the only stand-in.

Real SGLang code: the FastAPI app of ``http_server`` served by uvicorn on loopback, the
``TokenizerManager`` (real tokenization with a WordLevel tokenizer), the
``DataParallelController`` (its own __init__, ZMQ worker sockets and dispatch) and the
``DetokenizerManager``. The stand-in is ``SchedulerStandIn``: the DP-attention scheduler
processes a GPU would run. It reads the ``TokenizedGenerateReqInput`` each DP worker socket
receives and answers as a scheduler does, with a ``BatchTokenIDOutput`` to the detokenizer
(echoing the prompt's token ids) and the control replies to the tokenizer; for
``/update_weights_from_tensor`` it runs SGLang's model-runner ``WeightUpdater`` on a CPU module.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from array import array
from types import SimpleNamespace

import torch
import zmq

from sglang_cpu import import_sglang, write_tiny_model


class SchedulerStandIn:
    """Stand-in for the GPU scheduler processes (the boundary we cannot run on CPU): one PULL
    socket per DP worker port of the real DataParallelController; answers each request like
    a scheduler that generated the prompt back, tagged with its DP rank."""

    def __init__(self, io, worker_ports: list[int], port_args, weight_updater):
        self.io, self.weight_updater = io, weight_updater
        self.serializer = import_sglang("sglang.srt.utils.common").MultiprocessingSerializer
        self.rc = import_sglang("sglang.srt.runtime_context")
        self.ctx = zmq.Context()
        self.pulls = []
        for port in worker_ports:
            s = self.ctx.socket(zmq.PULL)
            s.connect(f"tcp://127.0.0.1:{port}")
            self.pulls.append(s)
        self.to_detokenizer = self.ctx.socket(zmq.PUSH)
        self.to_detokenizer.connect(port_args.detokenizer_ipc_name)
        self.to_tokenizer = self.ctx.socket(zmq.PUSH)
        self.to_tokenizer.connect(port_args.tokenizer_ipc_name)
        self.received: list[tuple[int, object]] = []  # (DP worker, request) in arrival order
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in self.pulls:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                rank = self.pulls.index(sock)
                req = self.io.sock_recv(sock)
                self.received.append((rank, req))
                try:
                    self._answer(rank, req)
                except Exception as e:  # the case reports it; the HTTP request times out
                    self.errors.append(f"{type(req).__name__}: {type(e).__name__}: {e}")

    def _answer(self, rank: int, req) -> None:
        io = self.io
        if isinstance(req, io.TokenizedGenerateReqInput):
            ids = list(req.input_ids)
            empty = [[]]
            out = io.BatchTokenIDOutput(
                rids=[req.rid], http_worker_ipcs=[req.http_worker_ipc],
                finished_reasons=[{"type": "length", "length": len(ids)}],
                decoded_texts=[""], decode_ids=[array("i", ids)], read_offsets=[0],
                output_ids=[array("i", ids)], skip_special_tokens=[True],
                spaces_between_special_tokens=[True], no_stop_trim=[False],
                prompt_tokens=[len(ids)], reasoning_tokens=[0], completion_tokens=[len(ids)],
                cached_tokens=[0], input_token_logprobs_val=empty,
                input_token_logprobs_idx=empty, output_token_logprobs_val=empty,
                output_token_logprobs_idx=empty, input_top_logprobs_val=empty,
                input_top_logprobs_idx=empty, output_top_logprobs_val=empty,
                output_top_logprobs_idx=empty, input_token_ids_logprobs_val=empty,
                input_token_ids_logprobs_idx=empty, output_token_ids_logprobs_val=empty,
                output_token_ids_logprobs_idx=empty, output_token_entropy_val=None,
                output_token_sampling_mask=None, output_hidden_states=None,
                routed_experts=None, indexer_topk=None, placeholder_tokens_idx=None,
                placeholder_tokens_val=None, retraction_counts=[0], dp_ranks=[rank])
            io.sock_send(self.to_detokenizer, out)
        elif isinstance(req, io.UpdateWeightsFromDistributedReqInput):
            # what the scheduler does: receive the broadcast (stand-in: no collective here, the
            # received tensors are filled with 3), then the model-runner WeightUpdater loads it
            weights = [(name, torch.full(shape, 3.0, dtype=getattr(torch, dtype)))
                       for name, dtype, shape in zip(req.names, req.dtypes, req.shapes)]
            with self.rc.get_parallel().override(tp_rank=0):
                ok, message = self.weight_updater.load_weights_from_distributed(weights)
            self._reply_to_control(io.UpdateWeightsFromDistributedReqOutput(
                success=ok, message=message), req)
        elif isinstance(req, io.UpdateWeightsFromTensorReqInput):
            # what the scheduler's weight updater does: its rank's payload, SGLang's serializer,
            # then SGLang's model-runner WeightUpdater (on a CPU model)
            named = self.serializer.deserialize(req.serialized_named_tensors[0])
            with self.rc.get_parallel().override(tp_rank=0):  # this scheduler's TP rank
                ok, message = self.weight_updater.update_weights_from_tensor(
                    named_tensors=named, load_format=req.load_format)
            self._reply_to_control(io.UpdateWeightsFromTensorReqOutput(success=ok,
                                                                       message=message), req)

    def _reply_to_control(self, out, req) -> None:
        # the TP-group broadcast makes every DP leader answer a control message
        out.rid, out.http_worker_ipc = req.rid, req.http_worker_ipc
        for _ in self.pulls:
            self.io.sock_send(self.to_tokenizer, out)

    def close(self) -> None:
        self._stop.set()
        self.thread.join()
        self.ctx.destroy(linger=0)


def start_http_server(app, port: int):
    """SGLang's FastAPI app served by uvicorn on loopback, in a thread (no lifespan: it would
    start SGLang's warmup requests against schedulers)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if time.monotonic() - t0 > 30 or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread


DENSE_NAME = "model.layers.0.self_attn.wo_a.weight"
ENGRAM_NAME = "model.layers.1.engram.embed.weight"


class TinyRunnerModel(torch.nn.Module):
    """A CPU model with a model's ``load_weights``: each (name, tensor) into its parameter."""

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)


def cpu_runner_weight_updater():
    """SGLang's model-runner WeightUpdater over a CPU module holding one dense weight and one
    Engram table under SGLang's parameter names. -> (updater, module)."""
    wu = import_sglang("sglang.srt.model_executor.model_runner_components.weight_updater")
    model = TinyRunnerModel()
    for name, shape in ((DENSE_NAME, (4, 4)), (ENGRAM_NAME, (8, 4))):
        *path, leaf = name.split(".")
        module = model
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape),
                                                           requires_grad=False))
    updater = wu.WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
        get_model=lambda: model, update_model_fields=lambda **_: None,
        recapture_cuda_graph=lambda: None, get_model_runner=lambda: SimpleNamespace(model=model))
    return updater, model


def ipc_update(updater, buckets) -> tuple[bool, str]:
    """SGLang's model-runner ``update_weights_from_ipc`` with checkpoint-engine's worker as the
    stand-in (a CUDA-IPC package): it hands each bucket of (name, tensor) to the loader SGLang
    gives it, as the real worker does with the buckets its parameter server sends."""
    worker = sys.modules.get("checkpoint_engine.worker")
    if worker is None:  # SGLang binds the worker's function once, at its first import
        worker = types.ModuleType("checkpoint_engine.worker")

        def update_weights_from_ipc(zmq_ctx, zmq_handle, device_id, *, run, post_hook=None):
            for bucket in worker.buckets:
                run(iter(bucket))
            if post_hook is not None:
                post_hook()

        worker.update_weights_from_ipc = update_weights_from_ipc
        sys.modules.update({"checkpoint_engine": types.ModuleType("checkpoint_engine"),
                            "checkpoint_engine.worker": worker})
    worker.buckets = buckets
    impl = import_sglang("sglang.srt.checkpoint_engine.checkpoint_engine_worker"
                         ).SGLangCheckpointEngineWorkerExtensionImpl
    impl.get_device_uuid = lambda self: "GPU-stand-in"  # the GPU's identity: none on CPU
    impl.get_device_id = lambda self: 0
    io = import_sglang("sglang.srt.managers.io_struct")
    rc = import_sglang("sglang.srt.runtime_context")
    with rc.get_parallel().override(tp_rank=0):
        return updater.update_weights_from_ipc(
            io.UpdateWeightsFromIPCReqInput(zmq_handles={"GPU-stand-in": "ipc://stand-in"}))


def serve_request_path(model_dir: str, free_port, weight_updater):
    """SGLang's TokenizerManager, DataParallelController (2 attention-DP ranks) and
    DetokenizerManager wired by SGLang's own PortArgs, behind its HTTP app.
    -> (base url, the scheduler stand-in, a stop function)."""
    sa = import_sglang("sglang.srt.server_args")
    rc = import_sglang("sglang.srt.runtime_context")
    io = import_sglang("sglang.srt.managers.io_struct")
    dpc = import_sglang("sglang.srt.managers.data_parallel_controller")
    detok = import_sglang("sglang.srt.managers.detokenizer_manager")
    engine = import_sglang("sglang.srt.entrypoints.engine")
    http = import_sglang("sglang.srt.entrypoints.http_server")

    http_port = free_port()
    args = sa.prepare_server_args([
        "--model-path", write_tiny_model(model_dir), "--device", "cpu", "--tp-size", "2",
        "--attn-dp-size", "2", "--load-balance-method", "round_robin", "--host", "127.0.0.1",
        "--port", str(http_port)])
    args.resolve_once()  # what Engine._launch_subprocesses does before it publishes
    rc.publish(args, role="tokenizer")
    port_args = sa.PortArgs.init_new(args)

    class DataParallelController(dpc.DataParallelController):
        """SGLang's controller; only its launch of the GPU scheduler processes (the TP group
        behind the worker sockets its __init__ bound) is the stand-in."""

        def launch_tensor_parallel_group(self, server_args, port_args, base_gpu_id, dp_rank,
                                         worker_ports=None):
            self.schedulers = SchedulerStandIn(io, worker_ports, port_args, weight_updater)

    controller = DataParallelController(args, port_args, run_scheduler_process_func=None)
    detokenizer = detok.DetokenizerManager(args, port_args)
    stop = threading.Event()

    # SGLang's event loops never return (the controller's busy-polls with NOBLOCK); these run
    # the same dispatchers on a blocking poll, so the case can stop them and close the sockets
    def controller_loop():
        while not stop.is_set():
            if controller.recv_from_tokenizer.poll(50):
                controller._request_dispatcher(io.sock_recv(controller.recv_from_tokenizer))

    def detokenizer_loop():
        while not stop.is_set():
            if detokenizer.recv_from_scheduler.poll(50):
                output = detokenizer._request_dispatcher(
                    io.sock_recv(detokenizer.recv_from_scheduler))
                if output is not None:
                    io.sock_send(detokenizer.send_to_tokenizer, output)

    threads = [threading.Thread(target=loop, daemon=True)
               for loop in (controller_loop, detokenizer_loop)]
    for t in threads:
        t.start()
    tokenizer_manager, template_manager = engine.init_tokenizer_manager(args, port_args)
    tokenizer_manager.max_req_input_len = 1024  # the scheduler reports it at start-up
    http.set_global_state(http._GlobalState(tokenizer_manager=tokenizer_manager,
                                            template_manager=template_manager,
                                            scheduler_info={}))
    server, server_thread = start_http_server(http.app, http_port)

    def close():
        server.should_exit = True
        server_thread.join(timeout=10)
        stop.set()
        for t in threads:
            t.join()
        controller.schedulers.close()
        # a zmq context left to the garbage collector blocks in term() while sockets live
        for ctx in (controller.context, detokenizer.recv_from_scheduler.context,
                    tokenizer_manager.recv_from_detokenizer.context):
            ctx.destroy(linger=0)

    return f"http://127.0.0.1:{http_port}", controller.schedulers, close


def request_path_case(work_dir: str, run_dir: str) -> dict:
    """/generate pins, routing_key stickiness, /health with a stall report and Engram weight
    updates, over real HTTP through SGLang's request path."""
    import requests
    import torch

    from sglang_dsv41.policies.watchdog import StallReport
    from sglang_dsv41.ports import free_port
    from sglang_dsv41.sglang_backend.watchdog_hooks import write_stall_report

    serializer = import_sglang("sglang.srt.utils.common").MultiprocessingSerializer
    tensor_bucket = import_sglang("sglang.srt.weight_sync.tensor_bucket")
    updater, runner_model = cpu_runner_weight_updater()
    url, schedulers, close = serve_request_path(os.path.join(work_dir, "request_path_model"),
                                                free_port, updater)
    out: dict = {}
    try:
        def generate(extra=None, headers=None):
            n = len(schedulers.received)
            r = requests.post(f"{url}/generate", json={
                "text": "hello world again", "sampling_params": {"max_new_tokens": 3},
                **(extra or {})}, headers=headers or {}, timeout=20)
            reached = [(rank, req.routed_dp_rank, req.routing_key, list(req.input_ids))
                       for rank, req in schedulers.received[n:]]
            body = r.json()
            return {"status": r.status_code, "reached": reached,
                    "text": body.get("text"), "dp_rank": body.get("meta_info", {}).get("dp_rank"),
                    "error": body.get("error", {}).get("message")}

        for label, extra, headers in (
                ("header", {}, {"X-Data-Parallel-Rank": "1"}), ("none", {}, {}),
                ("empty_header", {}, {"X-Data-Parallel-Rank": ""}),
                ("body_agrees", {"routed_dp_rank": 1}, {"X-Data-Parallel-Rank": "1"}),
                ("conflict", {"routed_dp_rank": 0}, {"X-Data-Parallel-Rank": "1"}),
                ("alias_agrees", {"data_parallel_rank": 1}, {"X-Data-Parallel-Rank": "1"}),
                ("alias_conflict", {"data_parallel_rank": 0}, {"X-Data-Parallel-Rank": "1"}),
                ("out_of_range", {}, {"X-Data-Parallel-Rank": "2"}),
                ("not_int", {}, {"X-Data-Parallel-Rank": "one"})):
            out[label] = generate(extra, headers)
        os.environ["SGLANG_DSV41_DP_DISPATCH"] = "routing_key"  # --dsv41-dp-dispatch
        try:
            out["sticky"] = [generate({"routing_key": key})["reached"][0][:3]
                             for key in ("s1", "s1", "s2", "s3", "s2", "s4", "s1", "s3")]
            out["sticky_pinned"] = generate({"routing_key": "s1"},
                                            {"X-Data-Parallel-Rank": "1"})["reached"]
        finally:
            del os.environ["SGLANG_DSV41_DP_DISPATCH"]

        write_stall_report(run_dir, StallReport(rank=3, step=7, op="mlp_sync", waited_s=2.5))
        r = requests.get(f"{url}/health", timeout=20)
        out["health"] = [r.status_code, r.json()]
        out["health_generate"] = requests.get(f"{url}/health_generate", timeout=20).status_code

        def push_distributed(names, shapes):
            n = len(schedulers.received)
            r = requests.post(f"{url}/update_weights_from_distributed", json={
                "names": names, "dtypes": ["float32"] * len(names), "shapes": shapes,
                "group_name": "g"}, timeout=20)
            return [r.status_code, r.json()["message"],
                    [type(req).__name__ for _, req in schedulers.received[n:]]]

        out["engram_distributed"] = push_distributed([DENSE_NAME, ENGRAM_NAME], [[4, 4], [8, 4]])
        out["engram_distributed_nothing_loaded"] = bool(
            (runner_model.get_parameter(DENSE_NAME) == 0).all()
            and (runner_model.get_parameter(ENGRAM_NAME) == 0).all())
        out["dense_distributed"] = push_distributed([DENSE_NAME], [[4, 4]])
        out["dense_distributed_loaded"] = bool((runner_model.get_parameter(DENSE_NAME) == 3).all())

        def push_tensor(name, value, load_format="direct"):
            named = [(name, value)]
            if load_format == "flattened_bucket":  # SGLang's bucket: one tensor + metadata
                bucket = tensor_bucket.FlattenedTensorBucket(named_tensors=named)
                named = {"flattened_tensor": bucket.get_flattened_tensor(),
                         "metadata": bucket.get_metadata()}
            payload = serializer.serialize(named, output_str=True)
            r = requests.post(f"{url}/update_weights_from_tensor", json={
                "serialized_named_tensors": [payload, payload], "load_format": load_format},
                timeout=20)
            return [r.status_code, r.json()["message"]]

        out["engram_tensor"] = push_tensor(ENGRAM_NAME, torch.ones(8, 4))
        out["engram_bucket"] = push_tensor(ENGRAM_NAME, torch.ones(8, 4), "flattened_bucket")
        out["engram_table_untouched"] = bool((runner_model.get_parameter(ENGRAM_NAME) == 0).all())
        out["dense_tensor"] = push_tensor(DENSE_NAME, torch.full((4, 4), 2.0))
        out["dense_loaded"] = bool((runner_model.get_parameter(DENSE_NAME) == 2).all())
        # from IPC (checkpoint-engine): each bucket checked before the model loads it
        out["engram_ipc"] = list(ipc_update(updater, [[(DENSE_NAME, torch.full((4, 4), 5.0))],
                                                      [(ENGRAM_NAME, torch.ones(8, 4))]]))
        out["engram_ipc_loaded"] = [runner_model.get_parameter(DENSE_NAME)[0, 0].item(),
                                    runner_model.get_parameter(ENGRAM_NAME).abs().sum().item()]
        out["dense_ipc"] = list(ipc_update(updater, [[(DENSE_NAME, torch.full((4, 4), 6.0))]]))
        out["dense_ipc_loaded"] = runner_model.get_parameter(DENSE_NAME)[0, 0].item()
        out["loader_restored"] = "load_weights" not in vars(runner_model)
    finally:
        close()
    out["scheduler_errors"] = schedulers.errors
    return out
