"""Process entry points: SGLang spawns its scheduler and DP-controller processes (start method
"spawn"), so patches made in the main process do not reach them. Our entry functions are
pickled by reference; each child imports sglang_dsv41.sglang_backend.entry and applies its
patches before SGLang builds the scheduler or controller."""

from __future__ import annotations

from typing import Callable

from ..registry import Patch, Target
from . import VERSIONS

SCHEDULER_PARAMS = ("server_args", "port_args", "gpu_id", "tp_rank", "attn_cp_rank",
                    "moe_dp_rank", "moe_ep_rank", "pp_rank", "dp_rank", "pipe_writer")
DP_CONTROLLER_PARAMS = ("server_args", "port_args", "pipe_writer", "run_scheduler_process_func")


def make_dp_controller_entry(orig: Callable) -> Callable:
    from ..entry import run_data_parallel_controller_process

    return run_data_parallel_controller_process


PATCHES = [
    Patch("process_entry.scheduler", "process_entry",
          Target("sglang.srt.managers.scheduler", "run_scheduler_process", SCHEDULER_PARAMS),
          "main", VERSIONS,
          "checked only: launch_server(run_scheduler_process_func=entry.run_scheduler_process) "
          "wraps it, so every scheduler process applies the scheduler patches first"),
    Patch("process_entry.launch_server", "process_entry",
          Target("sglang.srt.entrypoints.http_server", "launch_server",
                 ("server_args", "init_tokenizer_manager_func", "run_scheduler_process_func",
                  "run_detokenizer_process_func", "execute_warmup_func", "launch_callback")),
          "main", VERSIONS,
          "checked only: takes our scheduler entry function"),
    Patch("process_entry.dp_controller", "process_entry",
          Target("sglang.srt.managers.data_parallel_controller",
                 "run_data_parallel_controller_process", DP_CONTROLLER_PARAMS,
                 bound_in="sglang.srt.entrypoints.engine"),
          "main", VERSIONS,
          "the engine spawns entry.run_data_parallel_controller_process, which applies the "
          "DP-controller patches and hands our scheduler entry on",
          make=make_dp_controller_entry),
]
