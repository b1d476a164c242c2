"""Calls on a running stack's public Generation API, from plain values.

``build_request`` turns a prompt and sampling/stop values into a GenerateRequest (for this
module's blocking calls and for asyncio clients alike); ``generate`` streams one Generate
call; ``model_info`` and ``fetch_profile`` are the unary calls. Each call opens its own
channel to ``address``; ``tls`` says how: a ``ClientTLS``, None for plaintext, or "env" (the
default): TLS when TOKENMILL_TLS_CA / TOKENMILL_TLS_CERT / TOKENMILL_TLS_KEY are set, else plaintext.
Errors arrive as ``grpc.RpcError``; nothing here prints.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

import os

import grpc

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.tls import ClientTLS


TLSChoice = ClientTLS | Literal["env"] | None
"""A ClientTLS, None (plaintext) or "env" (ClientTLS.from_env(): the TOKENMILL_TLS_* variables)."""


DEFAULT_PORT = 50051
"""The scheduler's public port (services/scheduler/config.py, which the stack does not import)."""


def default_address(environ: Mapping[str, str] | None = None) -> str:
    """Where a client command finds the stack when given no --address: TOKENMILL_ADDRESS, else
    loopback on the port a stack started here listens on (TOKENMILL_SCHEDULER_PORT, else 50051)."""
    env = os.environ if environ is None else environ
    if env.get("TOKENMILL_ADDRESS"):
        return env["TOKENMILL_ADDRESS"]
    return f"127.0.0.1:{env.get('TOKENMILL_SCHEDULER_PORT') or DEFAULT_PORT}"


def open_channel(address: str, tls: TLSChoice = "env") -> grpc.Channel:
    """A blocking channel to ``address``, plaintext or TLS as ``tls`` says."""
    if tls == "env":
        tls = ClientTLS.from_env()
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.credentials())


def build_request(prompt: str | list[int] | None, *, max_tokens: int = 128, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                  ignore_eos: bool = False, stop: list[str] | tuple[str, ...] = (),
                  bos_token_id: int | None = None,
                  chat: Sequence[Mapping[str, str]] | None = None) -> generation_pb2.GenerateRequest:
    """A text prompt, or token ids, or a conversation (``chat``: {"role", "content"} dicts, rendered
    by the server's chat template with the assistant's cue); with none, BOS alone when
    ``bos_token_id`` is given."""
    req = generation_pb2.GenerateRequest()
    if chat is not None:
        if prompt:
            raise ValueError("give either a prompt or chat messages, not both")
        for message in chat:
            req.chat.messages.add(role=message["role"], content=message["content"])
    elif isinstance(prompt, list):
        req.token_ids.ids.extend(prompt)
    elif prompt:
        req.text = prompt
    elif bos_token_id is not None:
        req.token_ids.ids.append(bos_token_id)  # no prompt: start from BOS alone
    req.sampling.temperature = temperature
    req.sampling.top_k = top_k
    req.sampling.top_p = top_p
    req.sampling.min_p = min_p
    if seed is not None:
        req.sampling.seed = seed
    req.stop.max_tokens = max_tokens
    req.stop.ignore_eos = ignore_eos
    req.stop.stop.extend(stop)
    return req


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``token`` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def generate(address: str, request: generation_pb2.GenerateRequest, timeout: float | None = 300.0,
             tls: TLSChoice = "env", token: str | None = None) -> Iterator[generation_pb2.GenerateResponse]:
    """The stream's messages as they arrive (Started, Deltas, Finished). Closing the iterator
    early cancels the call, which aborts the request on the server. ``token``: a bearer token,
    for an engine with tenants."""
    with open_channel(address, tls) as channel:
        yield from generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout,
                                                                        metadata=bearer(token))


def model_info(address: str, timeout: float = 10.0, tls: TLSChoice = "env",
               token: str | None = None) -> generation_pb2.ModelInfo:
    with open_channel(address, tls) as channel:
        return generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                                       timeout=timeout, metadata=bearer(token))


def fetch_profile(address: str, window_s: float | None = None, timeout: float = 10.0,
                  tls: TLSChoice = "env", token: str | None = None) -> generation_pb2.LatencyProfile:
    """The scheduler's latency profile over the last ``window_s`` seconds (None: its configured window)."""
    request = generation_pb2.GetProfileRequest()
    if window_s is not None:
        request.window_seconds = window_s
    with open_channel(address, tls) as channel:
        return generation_pb2_grpc.GenerationStub(channel).GetProfile(request, timeout=timeout,
                                                                      metadata=bearer(token))
