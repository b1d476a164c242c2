"""One socket write per turn of the event loop for everything an HTTP answer writes in that turn.

uvicorn writes each ASGI message the moment it is sent: a streamed answer's headers, then its
first chunk; its last chunk, ``[DONE]`` and the chunked-encoding terminator; each its own
``send`` on the socket. The headers of a streamed answer go out only once its first token is in
hand (everything that can fail before it gets its own status), so header and token are always
written back to back, and on loopback every write also wakes the reader: on the critical path
of the first token, one more system call, one more wake-up of the client, which on a machine
with few cores takes the core from someone. This transport holds what is written during one turn
of the loop and writes it as one buffer at the end of the turn (``call_soon``): nothing waits
longer than the callbacks already queued, and nothing waits at all once a turn has written
``FLUSH_BYTES``.
"""

from __future__ import annotations

import asyncio
from typing import Any

FLUSH_BYTES = 64 * 1024
"""Written at once past this many held bytes (a large answer is not copied into one buffer)."""


class CoalescingTransport(asyncio.Transport):
    """``transport`` with writes held to the end of the loop's turn; everything else passes through."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._held_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))
        self._held_bytes += len(data)
        if self._held_bytes >= FLUSH_BYTES:
            self.flush()

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Write what is held now (a no-op with nothing held; what a closed connection held is dropped)."""
        if not self._held:
            return
        data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held.clear()
        self._held_bytes = 0
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held.clear()
        self._held_bytes = 0
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def get_write_buffer_size(self) -> int:
        return self._held_bytes + self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.flush()
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()
