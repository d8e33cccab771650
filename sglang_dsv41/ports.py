"""A free loopback TCP port, for the servers, rendezvous stores and process groups that the
trainer, the benchmarks and the tests start on one host."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
