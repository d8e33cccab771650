"""What both HTTP front ends (the embedded engine's server and the gateway) need from ASGI."""

from __future__ import annotations

from starlette.requests import Request


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects. Call it once the body is read: the next message
    the request receives is then the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
