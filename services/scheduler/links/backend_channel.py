"""A backend's channel, made and remade the same way by every link.

Each link (executor, tokenizer, drafter) reaches one backend address: over TLS when the
deployment has it (the files read when the channel is made, so a channel made after a rotation
uses the new ones), with the deployment's internal secret on every call
(services/common/internal_secret.py), and with the short reconnect back-off of
``BACKEND_CHANNEL_OPTIONS``. A session that ends is reopened on a fresh channel, so a restarted
backend is reached without waiting out the old channel's back-off.
"""

from __future__ import annotations

import grpc.aio

from services.common.errors import UnavailableError
from services.common.internal_secret import call_metadata
from services.common.server import create_channel
from services.common.tls import ClientTLS
from services.scheduler.links.channel import BACKEND_CHANNEL_OPTIONS, wait_ready


class BackendChannel:
    def __init__(self, backend: str, address: str, tls: ClientTLS | None = None, secret: str = "") -> None:
        self.backend = backend
        """What the backend is, as errors name it ("executor")."""
        self.address = address
        self.tls = tls
        self.metadata = call_metadata(secret)
        """Sent on every call."""
        self.channel: grpc.aio.Channel | None = None

    def open(self) -> grpc.aio.Channel:
        """A channel made now: the first, or through ``reopen`` a fresh one."""
        self.channel = create_channel(self.address, tls=self.tls, options=BACKEND_CHANNEL_OPTIONS)
        return self.channel

    async def reopen(self) -> grpc.aio.Channel:
        """A fresh channel in place of the current one, which is closed."""
        old = self.channel
        self.open()
        if old is not None:
            await old.close()
        return self.channel

    async def ready(self, timeout: float) -> None:
        """Wait until the channel connects; UnavailableError naming the address after ``timeout``."""
        await wait_ready(self.required(), self.address, timeout)

    def required(self) -> grpc.aio.Channel:
        """The channel; UnavailableError when there is none (not connected, or closed)."""
        if self.channel is None:
            raise UnavailableError(f"{self.backend} at {self.address} is not connected")
        return self.channel

    async def close(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            await channel.close()
