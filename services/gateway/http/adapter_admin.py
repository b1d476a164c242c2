"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: LoRA adapters loaded and
unloaded on the engines of a model while they serve (vLLM's endpoints and fields, with ``model``
naming whose engines: the default model when absent).

Each tokenmill engine target of the model's route is asked through its scheduler's Admin API
(which loads on all of that engine's executors or on none); HTTP upstreams are skipped. The
first engine's refusal is the answer (400 naming the field and limit, 409 for a name already
loaded without ``replace``, 404 for an unknown adapter). A load is all-or-none across the route
as each engine's is across its executors: when one engine refuses, those that took it are put
back as they were (the adapter unloaded, or with ``replace`` the files it had reloaded).

Who may call them: with ``--api-keys-file``, a key with ``"admin": true`` (403 for the others);
the gateway then calls each engine with the target's own token, which the engine must know as
an admin tenant. Keyless, the caller's Authorization goes on to the engines, whose own admin
tenants decide (an engine without tenants lets any caller load: loopback development).
"""

from __future__ import annotations

import asyncio

import grpc
import structlog
from fastapi import Request
from pydantic import BaseModel, ConfigDict

from services.common.errors import InvalidArgumentError, PermissionDeniedError
from services.common.pb.tokenmill.v1 import admin_pb2, admin_pb2_grpc
from services.gateway.dispatch import engine_error
from services.gateway.http.context import HttpContext, api_key_of, context_of
from services.gateway.intake import forwarded_auth
from services.gateway.pool import Target

_log = structlog.get_logger("tokenmill.gateway.adapter_admin")

ADMIN_TIMEOUT_S = 180.0
"""An engine reads and checks the adapter's files on every executor: seconds for large ones."""


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    """The adapter's directory on the engines' executors, inside their --lora-dir (relative: taken inside it)."""
    model: str | None = None
    replace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    model: str | None = None


async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> dict:
    ctx, parent, engines, metadata = _engines(request, body.model)
    message = admin_pb2.AdminLoadAdapterRequest(name=body.lora_name, path=body.lora_path, replace=body.replace)
    had = await _paths_before(engines, metadata, body.lora_name) if body.replace and len(engines) > 1 else {}

    async def roll_back(took: list[Target]) -> None:
        await _roll_back(took, metadata, body.lora_name, had)

    replies = await _each(ctx, engines, metadata, lambda stub: stub.LoadAdapter, roll_back)(message)
    info = replies[0]
    return {"object": "lora_adapter", "id": info.name, "parent": parent, "rank": info.rank, "alpha": info.alpha,
            "target_modules": list(info.target_modules), "engines": len(engines)}


async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> dict:
    ctx, parent, engines, metadata = _engines(request, body.model)
    await _each(ctx, engines, metadata, lambda stub: stub.UnloadAdapter)(
        admin_pb2.AdminUnloadAdapterRequest(name=body.lora_name))
    return {"object": "lora_adapter", "id": body.lora_name, "parent": parent, "deleted": True}


async def _paths_before(engines: list[Target], metadata: tuple | None, name: str) -> dict[str, str]:
    """Each engine's directory for the adapter ``name`` before a replacing load (absent: none)."""
    async def one(target: Target) -> str | None:
        listed = await admin_pb2_grpc.AdminStub(target.channel).ListAdapters(
            admin_pb2.ListAdaptersRequest(), timeout=ADMIN_TIMEOUT_S,
            metadata=metadata if metadata is not None else target.own_metadata)
        return next((info.path for info in listed.adapters if info.name == name), None)

    paths = await asyncio.gather(*(one(t) for t in engines), return_exceptions=True)  # one that fails: refuses too
    return {target.name: path for target, path in zip(engines, paths, strict=True) if isinstance(path, str)}


async def _roll_back(took: list[Target], metadata: tuple | None, name: str, had: dict[str, str]) -> None:
    """After a load another engine refused: the engines that took it serve ``name`` as before
    (unloaded where it was not served, the old files loaded again where it was). A rollback that
    fails is logged, not raised: the refusal is the answer."""
    async def one(target: Target) -> None:
        stub = admin_pb2_grpc.AdminStub(target.channel)
        auth = metadata if metadata is not None else target.own_metadata
        if target.name in had:
            await stub.LoadAdapter(admin_pb2.AdminLoadAdapterRequest(name=name, path=had[target.name], replace=True),
                                   timeout=ADMIN_TIMEOUT_S, metadata=auth)
        else:
            await stub.UnloadAdapter(admin_pb2.AdminUnloadAdapterRequest(name=name), timeout=ADMIN_TIMEOUT_S,
                                     metadata=auth)

    results = await asyncio.gather(*(one(t) for t in took), return_exceptions=True)
    for target, result in zip(took, results, strict=True):
        if isinstance(result, BaseException):
            _log.warning("adapter_rollback_failed", target=target.name, adapter=name, error=str(result))


def _engines(request: Request, model: str | None) -> tuple[HttpContext, str, list[Target], tuple | None]:
    ctx = context_of(request)
    key = api_key_of(request)
    if key is not None and not key.admin:
        raise PermissionDeniedError('this API key may not load or unload adapters; its entry in the API keys file '
                                    'needs "admin": true')
    route = ctx.dispatcher.route(model or ctx.dispatcher.default_model)
    if route.adapter:
        raise InvalidArgumentError(f"model '{route.adapter}' is an adapter; name its base model "
                                   f"('{route.model}')")
    engines = [ctx.dispatcher.pool.targets[leaf.name] for leaf in route.node.leaves()]
    engines = [target for target in engines if target.upstream is None and target.channel is not None]
    if not engines:
        raise InvalidArgumentError(f"model '{route.model}' has no tokenmill engine to load adapters on")
    metadata = forwarded_auth(request.headers.get("authorization")) if key is None else None
    return ctx, route.model, engines, metadata


def _each(ctx: HttpContext, engines: list[Target], metadata: tuple | None, method, roll_back=None):
    """A call of ``method`` on every engine at once; its first failure raised as the engine's
    error, after ``roll_back`` was given the engines whose call succeeded (when some did not) and
    every engine's model info was read again (so routing sees the change now)."""
    async def call(message):
        async def one(target: Target):
            stub = admin_pb2_grpc.AdminStub(target.channel)
            return await method(stub)(message, timeout=ADMIN_TIMEOUT_S,
                                      metadata=metadata if metadata is not None else target.own_metadata)

        results = await asyncio.gather(*(one(t) for t in engines), return_exceptions=True)
        took = [target for target, result in zip(engines, results, strict=True)
                if not isinstance(result, BaseException)]
        if roll_back is not None and took and len(took) < len(engines):
            await roll_back(took)
        await asyncio.gather(*(ctx.dispatcher.pool.read_model_info(t, ctx.timeout_s) for t in engines),
                             return_exceptions=True)
        for result in results:
            if isinstance(result, grpc.aio.AioRpcError):
                raise engine_error(result)
            if isinstance(result, BaseException):
                raise result
        return results

    return call
