"""Entry point: ``python -m trainer_bridge.train --preset tiny [--launch-server] [k=v ...]``,
or under ``torchrun --nproc-per-node N -m trainer_bridge.train ...`` for N FSDP ranks."""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import sys

from .config import RECIPES, load_config

LOCK_FILE = ".trainer.lock"
_lock_fd: int | None = None  # held (flock) for the whole run by rank 0

log = logging.getLogger("trainer_bridge")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainer_bridge.train", description=__doc__)
    p.add_argument("--preset", choices=sorted(RECIPES), default=None)
    p.add_argument("--config", default=None, help="YAML file applied on top of the preset")
    p.add_argument("--launch-server", action="store_true",
                   help="start the embedded server (server_args) and stop it at the end")
    p.add_argument("--dry-run", action="store_true", help="3 steps of checks, non-zero on failure")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--resume-from", default=None, metavar="PATH",
                   help="continue from this checkpoint directory (out_dir/checkpoints/step-N)")
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


class NothingToTrain(Exception):
    pass


def lock_run_dir(out_dir: str) -> None:
    """Rank 0: an exclusive flock on out_dir/.trainer.lock for the life of the process."""
    global _lock_fd
    path = os.path.join(out_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(f"{out_dir} is used by another trainer (pid {pid}): wait for it to "
                         f"finish, or choose another out_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _lock_fd = fd


def release_lock() -> None:
    global _lock_fd
    if _lock_fd is not None:
        os.close(_lock_fd)  # closing the file releases the flock
        _lock_fd = None


def check_writable(path: str) -> None:
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok\n")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{path} is not writable: {e.strerror or e}") from None


def previous_run(out_dir: str) -> list[str]:
    """What a previous run left in out_dir: checkpoints or metrics."""
    found = []
    ckpt = os.path.join(out_dir, "checkpoints")
    if os.path.isdir(ckpt) and any(n == "latest" or n.startswith("step-")
                                   for n in os.listdir(ckpt)):
        found.append("checkpoints/")
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    return found


def preflight(cfg, rank: int, world_size: int) -> None:
    """Everything that can be refused before a server starts or a model is built (ValueError:
    a bad input; NothingToTrain: a resume at or past cfg.steps)."""
    from .checkpoint import (check_world_size, latest_checkpoint, read_trainer_state,
                             remove_abandoned_saves)
    from .config import config_differences
    from .rollout import OfflineRolloutSource

    # Every rank needs a sample in every mini-batch (an empty one is an optimizer step without
    # a gradient on that rank).
    rc = cfg.rollout
    if rc.source == "offline":
        records = OfflineRolloutSource(rc.offline_path).records
        fewest = min(len(r["samples"]) for r in records)
        where = f"{rc.offline_path} has a step of {fewest}"
    else:
        fewest = rc.prompts_per_step * rc.group_size
        where = f"rollout.prompts_per_step x group_size = {fewest}"
    if fewest < cfg.loss.mini_batches * world_size:
        raise ValueError(f"loss.mini_batches={cfg.loss.mini_batches} x {world_size} rank(s) "
                         f"needs at least that many samples a step; {where}")
    if cfg.resume:
        root = os.path.join(cfg.out_dir, "checkpoints")
        path = cfg.resume_from or latest_checkpoint(root)
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint under {root} (start without "
                             f"--resume, or point out_dir at the run to continue)")
        cfg.resume_from = path  # what Trainer.load_latest loads
        state = read_trainer_state(path)
        check_world_size(path, state, world_size)
        changed = config_differences(state["config"], cfg) if "config" in state else []
        if changed:
            raise ValueError(f"--resume: {path} was trained with another config and a resume "
                             f"would silently keep it; make these keys match the checkpoint (or "
                             f"start a new run in another out_dir): {'; '.join(changed)}")
        if int(state["step"]) >= cfg.steps and not cfg.dry_run:
            raise NothingToTrain(f"nothing to train: {path} is at step {state['step']} and "
                                 f"steps={cfg.steps}; raise steps to train further")
    if rank != 0:
        return
    check_writable(cfg.out_dir)
    lock_run_dir(cfg.out_dir)
    check_writable(os.path.join(cfg.out_dir, "checkpoints"))
    removed = remove_abandoned_saves(os.path.join(cfg.out_dir, "checkpoints"))
    if removed:
        log.warning("removed %d checkpoint save(s) killed midway: %s", len(removed),
                    ", ".join(removed))
    found = previous_run(cfg.out_dir)
    if found and not cfg.resume and not cfg.dry_run:
        raise ValueError(f"{cfg.out_dir} holds a previous run ({', '.join(found)}): continue it "
                         f"with --resume, or start the new run in another out_dir")


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
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(args.preset, args.config, args.overrides + extra)
        if args.resume_from:
            cfg.resume, cfg.resume_from = True, args.resume_from
        preflight(cfg, rank, world_size)
    except NothingToTrain as e:
        if rank == 0:
            print(str(e), flush=True)
        return 0
    except (ValueError, OSError) as e:
        release_lock()
        print(f"error: {e}", file=sys.stderr)
        return 2

    from sglang_dsv41.server_process import ServerProcess

    from .checkpoint import CheckpointSaveError
    from .trainer import Trainer

    server = None
    if cfg.launch_server and rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        server = ServerProcess(server_argv(cfg), startup_timeout=300.0,
                               log_path=os.path.join(cfg.out_dir, "server.log"))
    trainer = None
    finished = False  # every rank got to the end together: close with a barrier
    try:
        try:
            trainer = Trainer(cfg, server_url=server.url if server else None)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if cfg.dry_run:
            from .dry_run import run_dry_run

            failures = run_dry_run(trainer)
            for f in failures:
                log.error("dry run: %s", f)
            if rank == 0:
                print("dry run: " + ("FAILED" if failures else "OK"), flush=True)
            finished = True
            return 1 if failures else 0
        try:
            history = trainer.train()
        except CheckpointSaveError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            if e.filename is None:  # not a file the run writes (metrics, plots): a real bug
                raise
            print(f"error: writing {e.filename} failed: {e.strerror or e}; the checkpoints "
                  f"saved before it are intact (--resume)", file=sys.stderr)
            return 1
        if rank == 0 and history:
            rewards = [round(h["reward_mean"], 3) for h in history]
            print(f"reward per step: {rewards}", flush=True)
        finished = True
        return 0
    finally:
        if server is not None:
            server.begin_stop()  # the server winds down while the trainer closes
        if trainer is not None:
            # After an error (maybe this rank's alone) no barrier: the job ends with it.
            trainer.close(failed=not finished)
        if server is not None:
            server.stop()
        release_lock()


if __name__ == "__main__":
    sys.exit(main())
