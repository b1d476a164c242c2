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
    """One worker's place: its process while it runs, started on demand, replaced when spent."""
    __slots__ = ("process", "jobs")

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self.jobs = 0

    async def take_job(self, vocabulary_path: str) -> asyncio.subprocess.Process:
        """The process for one more job: the running one, or a fresh one when it exited or is spent."""
        if self.process is not None and (self.process.returncode is not None or self.jobs >= RECYCLE_AFTER):
            await self.stop()
        if self.process is None:
            args = [vocabulary_path] if vocabulary_path else []
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.scheduler.structured.compile_worker", *args,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=REPLY_LIMIT)
            self.jobs = 0
        self.jobs += 1
        return self.process

    async def send(self, request: StructuredOutput, vocabulary_path: str) -> asyncio.subprocess.Process | None:
        """Hand ``request`` to the process (started if need be); None when it was gone before
        the job reached it (uvloop raises RuntimeError on a closed pipe), the slot then empty."""
        process = await self.take_job(vocabulary_path)
        job = {"kind": request.kind.value, "spec": request.spec, "options": list(request.options)}
        try:
            process.stdin.write(json.dumps(job).encode() + b"\n")
            await process.stdin.drain()
        except (ConnectionError, RuntimeError):
            await self.stop()
            return None
        return process

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()

    async def died(self, request: StructuredOutput) -> CompileCrash:
        """The process ended without a reply: a crash by a signal (the request's fault), else
        UnavailableError (it could not start: no fault of the request)."""
        code = await self.process.wait()
        self.process = None
        if code >= 0:
            _log.error("grammar_compile_worker_exited", code=code)
            raise UnavailableError(f"the grammar compile worker exited with code {code}; see the scheduler's log")
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        _log.warning("grammar_compile_crashed", field=request.field, signal=name)
        return CompileCrash(name)


class _Turn:
    """A tenant's share of the workers, and the compiles holding or waiting for it."""
    __slots__ = ("semaphore", "users")

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self.semaphore = semaphore
        self.users = 0


class _Shares(dict):
    """Each tenant's share of the workers (tenant -> its _Turn), held while it compiles."""

    def __init__(self, per_tenant: int) -> None:
        super().__init__()
        self.per_tenant = per_tenant

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str):
        """Wait for one of ``tenant``'s ``per_tenant`` places and hold it for the block."""
        turn = self.get(tenant)
        if turn is None:
            turn = self[tenant] = _Turn(asyncio.Semaphore(self.per_tenant))
        turn.users += 1
        try:
            async with turn.semaphore:
                yield
        finally:
            turn.users -= 1
            if not turn.users:  # forgotten once unused: tenants come and go without bound
                del self[tenant]


def _check_settings(workers: int, timeout_s: float, per_tenant: int) -> None:
    if workers < 1 or per_tenant < 1 or timeout_s <= 0:
        raise ValueError(f"compile workers need workers >= 1, per_tenant >= 1 and timeout_s > 0; got "
                         f"workers={workers}, per_tenant={per_tenant}, timeout_s={timeout_s}")


class CompileWorkers:
    def __init__(self, workers: int = 2, timeout_s: float = 5.0, per_tenant: int = 1,
                 vocabulary_path: str = "") -> None:
        _check_settings(workers, timeout_s, per_tenant)
        self.workers = workers
        self.timeout_s = timeout_s
        self.per_tenant = per_tenant
        self.vocabulary_path = vocabulary_path
        """The model's tokenizer.json, so first masks are built over the real vocabulary ("" = bytes)."""
        self._idle: asyncio.Queue[_Slot] | None = None
        self._tenants = _Shares(per_tenant)
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
        async with self._tenants.hold(tenant):
            slot = await self._idle.get()
            try:
                return await self._run_on(slot, request)
            finally:
                self._idle.put_nowait(slot)

    async def _run_on(self, slot: _Slot, request: StructuredOutput,
                      retry: bool = True) -> str | InvalidArgumentError | CompileCrash:
        process = await slot.send(request, self.vocabulary_path)
        if process is None:
            # The worker was gone before the job reached it: no fault of this request, so it
            # gets one fresh worker.
            _log.warning("grammar_compile_worker_gone_before_job", retry=retry)
            if retry:
                return await self._run_on(slot, request, retry=False)
            raise UnavailableError("the grammar compile worker exited before it read the job; see the scheduler's log")
        try:
            line = await asyncio.wait_for(process.stdout.readline(), self.timeout_s)
        except TimeoutError:
            await slot.stop()
            return InvalidArgumentError(f"{request.field} took longer than grammar_compile_timeout_s="
                                        f"{self.timeout_s:g} to compile")
        except (ConnectionError, ValueError):  # the worker died before it read the job
            line = b""
        except BaseException:
            await slot.stop()  # its reply would answer the next job
            raise
        if not line:
            crash = await slot.died(request)
            self.crashes += 1
            return crash
        reply = json.loads(line)
        return reply["grammar"] if "grammar" in reply else InvalidArgumentError(reply["error"])

    async def close(self) -> None:
        for slot in self._slots:
            await slot.stop()
