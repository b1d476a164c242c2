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


class GrammarCompiler:
    def __init__(self, max_grammar_bytes: int, cache_size: int = CACHE_SIZE,
                 workers: CompileWorkers | None = None) -> None:
        self.max_grammar_bytes = max_grammar_bytes
        self.cache_size = cache_size
        self.workers = workers
        """The compile worker processes (None: compile on a thread of this process)."""
        self._cache: OrderedDict[StructuredOutput, str | InvalidArgumentError] = OrderedDict()
        self._pending: dict[StructuredOutput, asyncio.Future] = {}
        self._quarantine: OrderedDict[str, str] = OrderedDict()
        self._bytes = None
        self.compiled = 0
        """Compilations run (cache misses), for tests and benchmarks."""

    async def compile(self, request: StructuredOutput, tenant: str = "") -> str:
        """The grammar for ``request``, compiled off the event loop unless cached, ``tenant``'s
        compiles bounded by the workers' per-tenant share. Raises InvalidArgumentError naming
        the field and the problem."""
        self.check_size(request)
        self._check_quarantine(request)
        cached = self._lookup(request)
        if cached is None:
            pending = self._pending.get(request)
            if pending is None:
                pending = asyncio.ensure_future(self._compile_off_loop(request, tenant))
                self._pending[request] = pending
                pending.add_done_callback(lambda _: self._pending.pop(request, None))
            cached = await asyncio.shield(pending)
        if isinstance(cached, InvalidArgumentError):
            raise InvalidArgumentError(str(cached))
        return cached

    def compile_now(self, request: StructuredOutput) -> str:
        """``compile`` on the calling thread (the in-process engine, tests)."""
        self.check_size(request)
        cached = self._lookup(request)
        if cached is None:
            cached = self._store(request, self._compile_here(request))
        if isinstance(cached, InvalidArgumentError):
            raise InvalidArgumentError(str(cached))
        return cached

    def check_size(self, request: StructuredOutput) -> None:
        size = request.num_bytes
        if size > self.max_grammar_bytes:
            raise InvalidArgumentError(f"{request.field} has {size} bytes; the limit is max_grammar_bytes="
                                       f"{self.max_grammar_bytes}")

    def is_quarantined(self, request: StructuredOutput) -> bool:
        return grammar_digest(request) in self._quarantine

    def _check_quarantine(self, request: StructuredOutput) -> None:
        signal = self._quarantine.get(grammar_digest(request))
        if signal is not None:
            raise InvalidArgumentError(f"{request.field} is quarantined: an identical one crashed the grammar "
                                       f"compiler ({signal}); it is refused without compiling")

    def _lookup(self, request: StructuredOutput) -> str | InvalidArgumentError | None:
        cached = self._cache.get(request)
        if cached is not None:
            self._cache.move_to_end(request)
        return cached

    async def _compile_off_loop(self, request: StructuredOutput, tenant: str) -> str | InvalidArgumentError:
        if self.workers is None:
            result = await asyncio.get_running_loop().run_in_executor(None, self._compile_here, request)
            return self._store(request, result)
        result = await self.workers.run(request, tenant)
        if isinstance(result, CompileCrash):
            self._quarantine[grammar_digest(request)] = result.signal
            while len(self._quarantine) > QUARANTINE_SIZE:
                self._quarantine.popitem(last=False)
            return InvalidArgumentError(f"{request.field} crashed the grammar compiler ({result.signal}); it is "
                                        "refused, and so will be every identical one")
        if isinstance(result, InvalidArgumentError) and "grammar_compile_timeout_s" in str(result):
            return result  # not cached: under load a fair grammar may take longer once
        return self._store(request, result)

    def _compile_here(self, request: StructuredOutput) -> str | InvalidArgumentError:
        try:
            return self._compile(request)
        except InvalidArgumentError as exc:
            return exc

    def _compile(self, request: StructuredOutput) -> str:
        if self._bytes is None:
            self._bytes = byte_vocabulary()
        return build(request, self._bytes)

    def _store(self, request: StructuredOutput, result: str | InvalidArgumentError) -> str | InvalidArgumentError:
        self.compiled += 1
        self._cache[request] = result
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return result
