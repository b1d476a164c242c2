"""LoRA adapters loaded and unloaded while serving, on every executor of the engine.

The engine's executors serve one set of adapters: a load goes to each connected executor, and
when one refuses it the others drop it again (an adapter served by some executors only would
fail the requests placed on the others). What was loaded or unloaded here is remembered and
replayed on an executor before it is attached (a restart comes back with its --lora flags
only; a new executor knows nothing), so the set survives executors coming and going. Changes
are serial (one lock): a replay never interleaves with a load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

import structlog

from services.common.adapter_paths import resolve_in_lora_dir
from services.common.adapters import MAX_ADAPTER_PATH_CHARS, AdapterInfo, name_problem
from services.common.errors import (
    AlreadyExistsError, FailedPreconditionError, InvalidArgumentError, UnavailableError)
from services.scheduler.engine.adapters import AdapterTable

_log = structlog.get_logger("tokenmill.scheduler.adapters")

NO_EXECUTOR = "no executor is connected to load the adapter on; retry once one is"


class AdapterPort(Protocol):
    address: str

    async def load_adapter(self, name: str, path: str) -> AdapterInfo: ...

    async def unload_adapter(self, name: str) -> bool: ...


class AdapterAdmin:
    def __init__(self, table: AdapterTable, executors: Callable[[], Sequence[AdapterPort]], lora_dir: str = "") -> None:
        self.table = table
        self.lora_dir = lora_dir  # --lora-dir, where loads may name adapters ("": loads are refused)
        self._executors = executors
        """The executors connected now."""
        self.loaded: dict[str, str] = {}
        """name -> path of the adapters loaded here, to load on executors that connect later."""
        self.unloaded: set[str] = set()
        """Names unloaded here, to unload from executors that connect with them (--lora)."""
        self._lock = asyncio.Lock()

    def list(self) -> list[AdapterInfo]:
        return self.table.all()

    async def load(self, name: str, path: str, replace: bool = False) -> AdapterInfo:
        """Serve the adapter at ``path`` under ``name`` on every executor (see the module)."""
        _check_load(name, path)
        resolve_in_lora_dir(self.lora_dir, path)  # the executor resolves it again, on its own filesystem
        async with self._lock:
            previous = self.table.get(name)
            if previous is not None and not replace:
                raise AlreadyExistsError(f"name: an adapter named {name!r} is already loaded (rank {previous.rank}); "
                                         "unload it first, or send replace=true to serve other files under it")
            executors = list(self._executors())
            if not executors:
                raise UnavailableError(NO_EXECUTOR)
            results = await asyncio.gather(*(e.load_adapter(name, path) for e in executors), return_exceptions=True)
            took = [e for e, r in zip(executors, results) if isinstance(r, AdapterInfo)]
            refused = next((r for r in results if isinstance(r, (InvalidArgumentError, FailedPreconditionError))), None)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if refused is not None or not took:
                await _undo(name, previous, took)
                raise refused if refused is not None else failed
            info = next(r for r in results if isinstance(r, AdapterInfo))
            self.loaded[name] = path
            self.unloaded.discard(name)
            self.table.learn([info])
            _log.info("adapter_loaded", adapter=name, rank=info.rank, executors=len(took),
                      fingerprint=info.fingerprint)
            return info

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` (NotFoundError listing the loaded ones when it is not)."""
        async with self._lock:
            self.table.resolve(name)
            self.table.forget(name)  # first: no request is admitted with it from now on
            self.loaded.pop(name, None)
            self.unloaded.add(name)
            results = await asyncio.gather(*(e.unload_adapter(name) for e in self._executors()),
                                           return_exceptions=True)
            for error in (r for r in results if isinstance(r, BaseException)):
                _log.warning("adapter_unload_failed", adapter=name, error=str(error))  # replayed at reconnect
            _log.info("adapter_unloaded", adapter=name)

    async def replay(self, executor: AdapterPort, reported: Sequence[AdapterInfo]) -> tuple[AdapterInfo, ...]:
        """Bring an executor that is connecting (its ``reported`` adapters) to the engine's set;
        the adapters it serves afterwards."""
        async with self._lock:
            return await _replay(executor, reported, self.loaded, self.unloaded)


def _check_load(name: str, path: str) -> None:
    if problem := name_problem(name):
        raise InvalidArgumentError(f"name: {problem}")
    if not path or len(path) > MAX_ADAPTER_PATH_CHARS:
        raise InvalidArgumentError(f"path must name the adapter's directory in 1-{MAX_ADAPTER_PATH_CHARS} "
                                   f"characters (MAX_ADAPTER_PATH_CHARS), got {len(path)}")


async def _replay(executor: AdapterPort, reported: Sequence[AdapterInfo], loaded: dict[str, str],
                  unloaded: set[str]) -> tuple[AdapterInfo, ...]:
    """An adapter whose files the executor cannot read is logged and left out: requests for it
    placed there fail, the others run."""
    adapters = {a.name: a for a in reported}
    for name in unloaded & set(adapters):
        await executor.unload_adapter(name)
        del adapters[name]
    for name, path in loaded.items():
        try:
            adapters[name] = await executor.load_adapter(name, path)
        except InvalidArgumentError as exc:
            adapters.pop(name, None)
            _log.error("adapter_replay_failed", adapter=name, executor=executor.address, error=str(exc))
    return tuple(adapters.values())


async def _undo(name: str, previous: AdapterInfo | None, took: list[AdapterPort]) -> None:
    """Executors that took a refused load go back to what they served under ``name``."""
    async def back(executor: AdapterPort) -> None:
        try:
            if previous is None:
                await executor.unload_adapter(name)
            else:
                await executor.load_adapter(name, previous.path)
        except Exception as exc:  # noqa: BLE001 - an executor gone now replays at reconnect
            _log.warning("adapter_undo_failed", adapter=name, executor=executor.address, error=str(exc))

    await asyncio.gather(*(back(e) for e in took))
