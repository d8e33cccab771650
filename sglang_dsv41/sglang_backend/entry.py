"""Entry functions of SGLang's spawned processes. SGLang pickles them by reference, so each
child imports this module, applies its patches, then runs SGLang's own entry function."""

from __future__ import annotations

import logging

from .env import ENV
from .registry import apply_patches, format_table
from .state import init_scheduler_process

logger = logging.getLogger(__name__)


def prepare_process(role: str, tp_rank: int = 0, tp_size: int = 1, dp_rank=None) -> list:
    disabled = ENV.DISABLED_PLUGINS.get()
    if role == "scheduler" and "stall_watchdog" not in disabled:
        init_scheduler_process(tp_rank, tp_size, dp_rank)
    elif role == "scheduler":
        from .state import STATE, RankInfo

        STATE.rank = RankInfo(tp_rank, tp_size, dp_rank)
    statuses = apply_patches(role, disabled)
    logger.info("sglang-dsv41 patches in %s process:\n%s", role, format_table(statuses))
    return statuses


def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, attn_cp_rank, moe_dp_rank,
                          moe_ep_rank, pp_rank, dp_rank, pipe_writer):
    prepare_process("scheduler", tp_rank, server_args.tp_size, dp_rank)
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_entry

    return sglang_entry(server_args, port_args, gpu_id, tp_rank, attn_cp_rank, moe_dp_rank,
                        moe_ep_rank, pp_rank, dp_rank, pipe_writer)


def run_data_parallel_controller_process(server_args, port_args, pipe_writer,
                                         run_scheduler_process_func=run_scheduler_process):
    prepare_process("dp_controller")
    from sglang.srt.managers import data_parallel_controller

    # the module's own function, not the engine's binding that launch() replaced with this one
    sglang_entry = data_parallel_controller.run_data_parallel_controller_process
    return sglang_entry(server_args, port_args, pipe_writer, run_scheduler_process_func)
