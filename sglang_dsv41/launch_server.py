"""``python -m sglang_dsv41.launch_server``: SGLang-compatible flags plus the plugin flags.

``--backend auto`` runs patched SGLang when it imports and a GPU is present, else the embedded
engine (scheduler processes + DP controller + FastAPI, all in sglang_dsv41.engine).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from .server_args import ServerArgs

logger = logging.getLogger("sglang_dsv41.launch_server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_dsv41.launch_server",
        description="Serve a DSV4.1-class model (SGLang API) with the sglang-dsv41 plugins.")
    ServerArgs.add_cli_args(parser)
    return parser


def parse_server_args(argv: list[str] | None = None,
                      allow_unknown: bool = False) -> tuple[ServerArgs, list[str]]:
    """argparse errors and ServerArgs validation errors both exit 2 with the reason. With
    ``allow_unknown`` the flags we do not own are returned (SGLang's own, for --backend sglang)."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown and not allow_unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return ServerArgs.from_cli_args(ns), unknown
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


# What launch_server itself reads for --backend sglang; SGLang parses and checks the rest (its
# flags share names with the embedded engine's, whose choices and checks are the engine's own).
SGLANG_MODE_FLAGS = ("--backend", "--stall-timeout", "--engram-layout",
                     "--health-check-timeout", "--log-level")


def requested_backend(argv: list[str]) -> str:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--backend", default=ServerArgs.backend)
    ns, _ = p.parse_known_args(argv)
    return ns.backend


def parse_sglang_mode_args(argv: list[str]) -> ServerArgs:
    """--backend sglang: our settings from SGLANG_MODE_FLAGS (the rest at their defaults); every
    other flag goes to SGLang unchanged, for SGLang's own parser to accept or refuse."""
    full = build_parser()
    parser = argparse.ArgumentParser(prog=full.prog, add_help=False)
    for action in full._actions:
        if set(action.option_strings) & set(SGLANG_MODE_FLAGS):
            parser._add_action(action)
    ns, _ = parser.parse_known_args(argv)
    values = {a.dest: getattr(ns, a.dest) for a in parser._actions}
    try:
        return ServerArgs(**values)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def sglang_available() -> bool:
    try:
        import sglang  # noqa: F401
        import torch
    except Exception:  # sglang pulls CUDA-only extensions that may fail in many ways
        return False
    return bool(torch.cuda.is_available())


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "sglang" if sglang_available() else "embedded"
    return backend


def run_sglang(server_args: ServerArgs, argv: list[str]) -> int:
    try:
        from .sglang_backend import launch
    except ImportError as e:
        logger.error("--backend sglang is unavailable: %s (install sglang-dsv41[sglang] on a "
                     "CUDA machine, or use --backend embedded)", e)
        return 1
    try:
        return int(launch(server_args, argv) or 0)
    except (ImportError, RuntimeError, ValueError) as e:  # no SGLang, or a patch target moved
        logger.error("--backend sglang failed: %s", e)
        return 1


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before spawning the engine, so a busy port fails in a second, not after loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit it: uvicorn (h11) writes a response's head and body separately,
    # and with Nagle on, every JSON answer waited ~40 ms for the client's delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        # Listening now: with SO_REUSEADDR a second bind of a port nobody listens on yet
        # succeeds on Linux, so two servers started together both loaded their engines and
        # the second failed only in uvicorn. uvicorn listens again (a no-op) when it serves.
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {e}") from e
    sock.set_inheritable(True)
    return sock


def build_state(engine):
    from .engine.http_server import ServerState
    from .engine.launcher import context_length_for
    from .engine.request_limits import RequestLimits
    from .tokenizer import load_model_tokenizer

    a, cfg = engine.server_args, engine.config
    tokenizer = load_model_tokenizer(engine.model_dir, cfg)
    limits = RequestLimits(vocab_size=cfg.vocab_size,
                           context_length=context_length_for(a, cfg),
                           max_new_tokens_limit=a.max_new_tokens_limit,
                           dp_size=a.effective_dp_size)
    versions = {str(i.get("weight_version")) for i in engine.ready_info.values()
                if i.get("weight_version") is not None}
    return ServerState(server_args=a, controller=engine.controller, tokenizer=tokenizer,
                       limits=limits, model_path=engine.model_dir, model_config=cfg,
                       ready_info=engine.ready_info,
                       weight_version=versions.pop() if len(versions) == 1 else "default")


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated()


async def _serve(server, sock: socket.socket, url: str, state) -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        logger.info("server ready at %s", url)
    while not server.should_exit and not task.done():
        await asyncio.sleep(0.05)
    if not task.done():  # SIGTERM (or a dead rank): uvicorn drains the open requests
        state.draining = True
        grace = state.server_args.shutdown_grace  # uvicorn's timeout_graceful_shutdown
        # When the grace runs out uvicorn cancels what still runs and answers it with a bare
        # 500; end those requests a little earlier with a 503 that says why.
        try:
            await asyncio.wait_for(asyncio.shield(task), grace - min(1.0, grace / 4))
        except TimeoutError:
            cut = state.controller.cut_all(
                f"--shutdown-grace {grace:g} s ran out before this request finished")
            logger.warning("shutdown grace ran out: %d request(s) ended with 503", cut)
    await task


def run_embedded(server_args: ServerArgs) -> int:
    import uvicorn

    from .engine.http_server import create_app
    from .engine.launcher import EngineStartError, launch_engine

    # uvicorn re-raises a captured SIGTERM after its graceful stop; this handler turns it into an
    # exception, so the finally below still stops the scheduler processes.
    signal.signal(signal.SIGTERM, _on_sigterm)
    host, port = server_args.host, server_args.port
    try:
        sock = bind_socket(host, port)
    except OSError as e:
        logger.error("%s", e)
        return 1
    engine = None
    try:
        engine = launch_engine(server_args)
        state = build_state(engine)
        app = create_app(state)
        # SIGTERM: uvicorn stops accepting, in-flight requests finish within --shutdown-grace.
        config = uvicorn.Config(app, log_level=server_args.log_level, access_log=False,
                                timeout_graceful_shutdown=server_args.shutdown_grace)
        server = uvicorn.Server(config)
        engine.on_fatal = lambda reason: setattr(server, "should_exit", True)
        asyncio.run(_serve(server, sock, f"http://{host}:{port}", state))
        if engine.fatal_reason is not None:
            logger.error("exiting: %s", engine.fatal_reason)
            return 1
    except (EngineStartError, ValueError, OSError) as e:
        logger.error("cannot start the embedded engine: %s", e)
        return 1
    except (KeyboardInterrupt, _Terminated):
        logger.info("interrupted")
    finally:
        if engine is not None:
            logger.info("stopping %d scheduler processes", len(engine.processes))
            engine.shutdown()
        sock.close()
    return 0


def _setup_logging(server_args: ServerArgs) -> None:
    logging.basicConfig(level=server_args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    requested = requested_backend(argv)
    if requested not in ("auto", "embedded") and not wants_help:
        build_parser().parse_known_args(["--backend", requested])  # an unknown one: exits 2
    backend = "embedded" if wants_help else resolve_backend(requested)
    if backend == "sglang":
        server_args = parse_sglang_mode_args(argv)
        _setup_logging(server_args)
        logger.info("backend sglang (requested %s), pid %d", requested, os.getpid())
        return run_sglang(server_args, argv)  # SGLang's own flags pass through to it
    server_args, unknown = parse_server_args(argv, allow_unknown=True)
    _setup_logging(server_args)
    logger.info("backend %s (requested %s), pid %d", backend, requested, os.getpid())
    if unknown:
        build_parser().error(f"unrecognized arguments for the embedded backend: "
                             f"{' '.join(unknown)}")
    return run_embedded(server_args)


if __name__ == "__main__":
    sys.exit(main())
