"""Entry point: ``python -m trainer_bridge.train --preset tiny [--launch-server] [k=v ...]``,
or under ``torchrun --nproc-per-node N -m trainer_bridge.train ...`` for N FSDP ranks."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import RECIPES, load_config

log = logging.getLogger("trainer_bridge")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainer_bridge.train", description=__doc__)
    p.add_argument("--preset", choices=sorted(RECIPES), default=None)
    p.add_argument("--config", default=None, help="YAML file applied on top of the preset")
    p.add_argument("--launch-server", action="store_true",
                   help="start the embedded server (server_args) and stop it at the end")
    p.add_argument("--dry-run", action="store_true", help="3 steps of checks, non-zero on failure")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--optimizer-offload", choices=("none", "fsdp", "chunked"), default=None,
                   help="none: optimizer state on the device; fsdp: FSDP2 CPUOffloadPolicy; "
                        "chunked: Adam moments on the host, stepped in chunks through one "
                        "pinned buffer (same as optim.optimizer_offload=...)")
    p.add_argument("--fp32-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the head in fp32 (model.lm_head_fp32)")
    p.add_argument("overrides", nargs="*", help="section.key=value (YAML values)")
    return p.parse_intermixed_args(argv)


def server_argv(cfg) -> list[str]:
    argv = ["--model-path", cfg.model.model_path, *cfg.server_args]
    if cfg.model.checkpoint_cache_dir:
        argv += ["--checkpoint-cache-dir", cfg.model.checkpoint_cache_dir]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    extra = [f"launch_server={str(args.launch_server).lower()}"] if args.launch_server else []
    extra += ["dry_run=true"] if args.dry_run else []
    extra += ["resume=true"] if args.resume else []
    if args.optimizer_offload is not None:
        extra.append(f"optim.optimizer_offload={args.optimizer_offload}")
    if args.fp32_lm_head is not None:
        extra.append(f"model.lm_head_fp32={str(args.fp32_lm_head).lower()}")
    try:
        cfg = load_config(args.preset, args.config, args.overrides + extra)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from sglang_dsv41.server_process import ServerProcess

    from .trainer import Trainer

    server = None
    if cfg.launch_server and rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        server = ServerProcess(server_argv(cfg), startup_timeout=300.0,
                               log_path=os.path.join(cfg.out_dir, "server.log"))
    trainer = None
    try:
        trainer = Trainer(cfg, server_url=server.url if server else None)
        if cfg.dry_run:
            from .dry_run import run_dry_run

            failures = run_dry_run(trainer)
            for f in failures:
                log.error("dry run: %s", f)
            if rank == 0:
                print("dry run: " + ("FAILED" if failures else "OK"), flush=True)
            return 1 if failures else 0
        history = trainer.train()
        if rank == 0 and history:
            rewards = [round(h["reward_mean"], 3) for h in history]
            print(f"reward per step: {rewards}", flush=True)
        return 0
    finally:
        if server is not None:
            server.begin_stop()  # the server winds down while the trainer closes
        if trainer is not None:
            trainer.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
