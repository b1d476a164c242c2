"""The scheduler's grammar compile workers: a few child processes, shared fairly by tenants.

A structured output is attacker-chosen input to a native library, so the scheduler never
compiles one in its own process. Each worker (compile_worker.py) is a child process that
compiles one grammar at a time on a small native stack; here:

- a compile that kills its worker (a stack overflow in the library: SIGSEGV) costs that
  compile alone: its request is refused with INVALID_ARGUMENT, the worker is started again
  for the next job, and the scheduler and every other stream go on. ``CompileCrash`` tells
  the caller, which quarantines the grammar (grammar_compiler.py);
- a compile that runs past ``timeout_s`` is refused and its worker killed;
- a worker that exits on its own (it could not start) is the scheduler's fault, not the
  request's: UNAVAILABLE, nothing cached or quarantined;
- each tenant may hold at most ``per_tenant`` workers at once, so one tenant's stream of
  expensive grammars waits behind itself and leaves the other workers to the others;
- a worker is replaced after ``RECYCLE_AFTER`` jobs, so memory the library keeps does not grow
  for the life of the scheduler.

Workers start on first use (~0.3 s each: a Python interpreter and llguidance).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from dataclasses import dataclass

import structlog

from services.common.errors import InvalidArgumentError, UnavailableError
from services.scheduler.structured.structured_output import StructuredOutput

_log = structlog.get_logger("tokenmill.scheduler")

RECYCLE_AFTER = 1000
"""Jobs a worker runs before it is replaced."""

REPLY_LIMIT = 64 * 1024 * 1024
"""Longest reply line read from a worker (a compiled grammar is a few times its source)."""


@dataclass(frozen=True, slots=True)
class CompileCrash:
    """The worker died while compiling this request (``signal``: what killed it)."""

    signal: str


class _Slot:
    __slots__ = ("process", "jobs")

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self.jobs = 0


class _Turn:
    """A tenant's share of the workers, and the compiles holding or waiting for it."""
    __slots__ = ("semaphore", "users")

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self.semaphore = semaphore
        self.users = 0


class CompileWorkers:
    def __init__(self, workers: int = 2, timeout_s: float = 5.0, per_tenant: int = 1,
                 vocabulary_path: str = "") -> None:
        if workers < 1 or per_tenant < 1 or timeout_s <= 0:
            raise ValueError(f"compile workers need workers >= 1, per_tenant >= 1 and timeout_s > 0; got "
                             f"workers={workers}, per_tenant={per_tenant}, timeout_s={timeout_s}")
        self.workers = workers
        self.timeout_s = timeout_s
        self.per_tenant = per_tenant
        self.vocabulary_path = vocabulary_path
        """The model's tokenizer.json, so first masks are built over the real vocabulary ("" = bytes)."""
        self._idle: asyncio.Queue[_Slot] | None = None
        self._tenants: dict[str, _Turn] = {}
        self._slots: list[_Slot] = []
        self.crashes = 0
        """Workers that died in a compile, for tests and logs."""

    async def run(self, request: StructuredOutput, tenant: str = "") -> str | InvalidArgumentError | CompileCrash:
        """The compiled grammar, the refusal, or the crash, for ``request`` on behalf of ``tenant``."""
        if self._idle is None:
            self._slots = [_Slot() for _ in range(self.workers)]
            self._idle = asyncio.Queue()
            for slot in self._slots:
                self._idle.put_nowait(slot)
        turn = self._tenants.get(tenant)
        if turn is None:
            turn = self._tenants[tenant] = _Turn(asyncio.Semaphore(self.per_tenant))
        turn.users += 1
        try:
            async with turn.semaphore:
                slot = await self._idle.get()
                try:
                    return await self._run_on(slot, request)
                finally:
                    self._idle.put_nowait(slot)
        finally:
            turn.users -= 1
            if not turn.users:  # forgotten once unused: tenants come and go without bound
                del self._tenants[tenant]

    async def _run_on(self, slot: _Slot, request: StructuredOutput,
                      retry: bool = True) -> str | InvalidArgumentError | CompileCrash:
        if slot.process is not None and (slot.process.returncode is not None or slot.jobs >= RECYCLE_AFTER):
            await self._stop(slot)
        if slot.process is None:
            args = [self.vocabulary_path] if self.vocabulary_path else []
            slot.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.scheduler.structured.compile_worker", *args,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=REPLY_LIMIT)
            slot.jobs = 0
        process = slot.process
        slot.jobs += 1
        job = {"kind": request.kind.value, "spec": request.spec, "options": list(request.options)}
        try:
            process.stdin.write(json.dumps(job).encode() + b"\n")
            await process.stdin.drain()
        except (ConnectionError, RuntimeError):
            # The worker was gone before the job reached it (uvloop raises RuntimeError on a
            # closed pipe): no fault of this request, so it gets one fresh worker.
            _log.warning("grammar_compile_worker_gone_before_job", retry=retry)
            await self._stop(slot)
            if retry:
                return await self._run_on(slot, request, retry=False)
            raise UnavailableError("the grammar compile worker exited before it read the job; see the scheduler's log")
        try:
            line = await asyncio.wait_for(process.stdout.readline(), self.timeout_s)
        except TimeoutError:
            await self._stop(slot)
            return InvalidArgumentError(f"{request.field} took longer than grammar_compile_timeout_s="
                                        f"{self.timeout_s:g} to compile")
        except (ConnectionError, ValueError):  # the worker died before it read the job
            line = b""
        except BaseException:
            await self._stop(slot)  # its reply would answer the next job
            raise
        if not line:
            code = await process.wait()
            slot.process = None
            if code >= 0:  # it exited on its own (it could not start): no fault of this request
                _log.error("grammar_compile_worker_exited", code=code)
                raise UnavailableError(f"the grammar compile worker exited with code {code}; see the scheduler's log")
            self.crashes += 1
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            _log.warning("grammar_compile_crashed", field=request.field, signal=name)
            return CompileCrash(name)
        reply = json.loads(line)
        return reply["grammar"] if "grammar" in reply else InvalidArgumentError(reply["error"])

    async def _stop(self, slot: _Slot) -> None:
        process, slot.process = slot.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()

    async def close(self) -> None:
        for slot in self._slots:
            await self._stop(slot)
