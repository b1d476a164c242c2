"""uvicorn on the gateway's event loop, beside the gRPC server (one process, one loop).

The socket is bound here, so port 0 reports the port the OS chose before serving starts.
uvicorn's own signal handling is turned off: the process's SIGINT/SIGTERM belong to
``run_service``, which stops the HTTP server through ``HttpServer.stop`` like everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

import uvicorn

from services.gateway.http.connection_limits import ConnectionLimits, fitted_to_descriptors, limited_protocol

BACKLOG = 2048


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the process's signals are run_service's
        yield


@dataclass(eq=False)
class HttpServer:
    server: _Server
    task: asyncio.Task
    port: int
    sock: socket.socket

    def stop_accepting(self) -> None:
        """Close the listener now: uvicorn would only on its next tick (0.1 s or later), and a
        connection accepted in between reaches a server that health already calls NOT_SERVING."""
        for listener in self.server.servers:
            listener.close()
        self.sock.close()

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let open responses finish for ``grace`` seconds, then cut them."""
        self.stop_accepting()
        self.server.config.timeout_graceful_shutdown = max(grace, 0.2)
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout=grace + 2.0)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            self.task.cancel()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


async def start_http(app, host: str, port: int, limits: ConnectionLimits, keep_alive_s: float = 30.0) -> HttpServer:
    """Serve ``app`` on host:port (0 = any free port) with httptools under ``limits``
    (connection_limits.py); returns once listening."""
    sock = _bind(host, port)
    config = uvicorn.Config(app, http=limited_protocol(fitted_to_descriptors(limits)), lifespan="off",
                            log_level="warning", access_log=False, timeout_keep_alive=keep_alive_s, backlog=BACKLOG)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="gateway-http")
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1], sock)
