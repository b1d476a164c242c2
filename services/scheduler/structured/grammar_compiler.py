"""StructuredOutput -> the grammar the executor's matcher runs, compiled once per content.

llguidance (its Rust core: an Earley parser over a lazily built lexer) does the work, in the
scheduler as in the executor, with no torch in either's import; grammar_build.py is the
compile itself (bounds, translation, validation under explicit parser limits, the first mask).

The result is cached by content (an LRU of ``CACHE_SIZE`` entries, failures included), so a
schema sent by every request of an application is compiled once; concurrent requests with one
new schema share one compilation. ``compile`` runs the work off the event loop: in the
scheduler service on its compile worker processes (compile_workers.py), where a grammar that
crashes the library kills a worker, not the scheduler; without workers (tests) on a thread. The
request enters the waiting queue only once its grammar is ready.

A grammar that crashed a worker is quarantined by the hash of its content (``QUARANTINE_SIZE``
of them, kept apart from the cache so other traffic does not evict them): the same grammar
again is refused at once, without a worker.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from services.common.errors import InvalidArgumentError
from services.scheduler.structured.compile_workers import CompileCrash, CompileWorkers
from services.scheduler.structured.grammar_build import MAX_CHOICES, build, byte_vocabulary
from services.scheduler.structured.structured_output import StructuredOutput

__all__ = ["CACHE_SIZE", "MAX_CHOICES", "QUARANTINE_SIZE", "GrammarCompiler", "grammar_digest"]

CACHE_SIZE = 256

QUARANTINE_SIZE = 4096


def grammar_digest(request: StructuredOutput) -> str:
    """The hash a grammar is quarantined by: its kind and content."""
    digest = hashlib.sha256(request.kind.value.encode() + b"\0" + request.spec.encode())
    for option in request.options:
        digest.update(b"\0" + option.encode())
    return digest.hexdigest()


class _Quarantine:
    """Grammars that crashed a compile worker, by content hash: the latest ``size`` of them."""

    def __init__(self, size: int = QUARANTINE_SIZE) -> None:
        self._size = size
        self._signals: OrderedDict[str, str] = OrderedDict()

    def __contains__(self, request: StructuredOutput) -> bool:
        return grammar_digest(request) in self._signals

    def check(self, request: StructuredOutput) -> None:
        signal = self._signals.get(grammar_digest(request))
        if signal is not None:
            raise InvalidArgumentError(f"{request.field} is quarantined: an identical one crashed the grammar "
                                       f"compiler ({signal}); it is refused without compiling")

    def add(self, request: StructuredOutput, signal: str) -> InvalidArgumentError:
        """Quarantine ``request``; the refusal its own request gets."""
        self._signals[grammar_digest(request)] = signal
        while len(self._signals) > self._size:
            self._signals.popitem(last=False)
        return InvalidArgumentError(f"{request.field} crashed the grammar compiler ({signal}); it is "
                                    "refused, and so will be every identical one")


class _Lru(OrderedDict):
    """The ``size`` entries used last."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def lookup(self, key):
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def store(self, key, value) -> None:
        self[key] = value
        while len(self) > self.size:
            self.popitem(last=False)


class _Shared:
    """Concurrent callers asking for one key share one computation."""

    def __init__(self) -> None:
        self._pending: dict[object, asyncio.Future] = {}

    async def get(self, key, start: Callable[[], Awaitable]):
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(start())
            self._pending[key] = pending
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        return await asyncio.shield(pending)


def _grammar(result: str | InvalidArgumentError) -> str:
    if isinstance(result, InvalidArgumentError):
        raise InvalidArgumentError(str(result))
    return result


def _result_of(compile_: Callable[[StructuredOutput], str], request: StructuredOutput) -> str | InvalidArgumentError:
    try:
        return compile_(request)
    except InvalidArgumentError as exc:
        return exc


def check_grammar_size(request: StructuredOutput, max_grammar_bytes: int) -> None:
    size = request.num_bytes
    if size > max_grammar_bytes:
        raise InvalidArgumentError(f"{request.field} has {size} bytes; the limit is max_grammar_bytes="
                                   f"{max_grammar_bytes}")


class GrammarCompiler:
    def __init__(self, max_grammar_bytes: int, cache_size: int = CACHE_SIZE,
                 workers: CompileWorkers | None = None) -> None:
        self.max_grammar_bytes = max_grammar_bytes
        self.workers = workers
        """The compile worker processes (None: compile on a thread of this process)."""
        self._cache: _Lru = _Lru(cache_size)
        """StructuredOutput -> its grammar, or the InvalidArgumentError that refused it."""
        self._pending = _Shared()
        self._quarantine = _Quarantine()
        self._bytes = None
        self.compiled = 0
        """Compilations run (cache misses), for tests and benchmarks."""

    async def compile(self, request: StructuredOutput, tenant: str = "") -> str:
        """The grammar for ``request``, compiled off the event loop unless cached, ``tenant``'s
        compiles bounded by the workers' per-tenant share. Raises InvalidArgumentError naming
        the field and the problem."""
        self.check_size(request)
        self._quarantine.check(request)
        cached = self._cache.lookup(request)
        if cached is None:
            cached = await self._pending.get(request, lambda: self._compile_off_loop(request, tenant))
        return _grammar(cached)

    def compile_now(self, request: StructuredOutput) -> str:
        """``compile`` on the calling thread (the in-process engine, tests)."""
        self.check_size(request)
        cached = self._cache.lookup(request)
        if cached is None:
            cached = self._store(request, _result_of(self._compile, request))
        return _grammar(cached)

    def check_size(self, request: StructuredOutput) -> None:
        check_grammar_size(request, self.max_grammar_bytes)

    def is_quarantined(self, request: StructuredOutput) -> bool:
        return request in self._quarantine

    async def _compile_off_loop(self, request: StructuredOutput, tenant: str) -> str | InvalidArgumentError:
        if self.workers is None:
            result = await asyncio.get_running_loop().run_in_executor(None, _result_of, self._compile, request)
            return self._store(request, result)
        result = await self.workers.run(request, tenant)
        if isinstance(result, CompileCrash):
            return self._quarantine.add(request, result.signal)
        if isinstance(result, InvalidArgumentError) and "grammar_compile_timeout_s" in str(result):
            return result  # not cached: under load a fair grammar may take longer once
        return self._store(request, result)

    def _compile(self, request: StructuredOutput) -> str:
        if self._bytes is None:
            self._bytes = byte_vocabulary()
        return build(request, self._bytes)

    def _store(self, request: StructuredOutput, result: str | InvalidArgumentError) -> str | InvalidArgumentError:
        self.compiled += 1
        self._cache.store(request, result)
        return result
