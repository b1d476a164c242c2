"""The Executor gRPC servicer: executor.proto <-> ModelRunner.

Step is a session. One bidirectional stream carries every step of one scheduler: each
StepRequest yields exactly one StepResponse, in order, and the runner keeps the sequences'
state between them. When the stream ends for any reason (the scheduler closed it, went away,
was cancelled, or sent an invalid plan) every sequence is forgotten, so a restarted
scheduler starts from a clean executor. The KV blocks need no freeing: the scheduler owns
their accounting and a new one starts with all of them free.

Only one session at a time: the sequence ids and block ids of two schedulers would collide
in one runner, so a second concurrent Step call fails with FAILED_PRECONDITION. A session
that sends nothing for ``idle_timeout_s`` is ended (the scheduler sends an empty step while
idle), and every plan is checked before it is queued (step_guard.py).

The model runs in one dedicated worker thread (``loop.run_in_executor``), never on the event
loop, so health checks and GetExecutorInfo answer while a step computes. The same thread
runs the model loading and the end-of-session cleanup, which orders them with the steps:
a cleanup submitted while a cancelled session's last step still runs happens after it, and
a new session's first step after the cleanup. Each plan is queued on the worker as soon as
it arrives, so with overlapped scheduling the next step is already waiting when one ends;
the worker runs them in arrival order, which the scheduler relies on (step N+1 may compute
the token step N samples). Results go back in the same order.

PrepareGrammar builds a grammar's matcher and first mask on a thread of its own, beside the
step worker, when the scheduler admits a constrained request: the step that first runs the
sequence then copies it instead of building it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

import grpc
import structlog

from services.common.adapter_paths import resolve_in_lora_dir
from services.common.codec.step_codec import adapter_to_proto, executor_info_to_proto, plan_from_proto, result_to_proto
from services.common.errors import InvalidArgumentError, TokenmillError, UnavailableError
from services.common.stream_session import logged_stream
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.common.step import ExecutorInfo, StepPlan, StepResult
from services.common.tls import ClientTLS
from services.executor.kv_transfer import KVTransfer
from services.executor.step_guard import check_plan, idle_limited

_log = structlog.get_logger("tokenmill.executor")


class StepSessionBusyError(TokenmillError):
    """A Step stream was opened while another one still drives the executor."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StepRunner(Protocol):
    """What the servicer needs of ModelRunner (tests substitute a slow fake)."""

    sequences: dict

    def execute(self, plan: StepPlan) -> StepResult: ...

    def info(self) -> ExecutorInfo: ...


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Serves one runner; `worker` must be a single-thread executor, the only thread touching it.

    ``runner`` resolves once the model has loaded and warmed up: the server binds before that,
    and answers UNAVAILABLE until then. ``observe_step``, when given, receives each step's
    compute time in seconds (the executor's step histogram)."""

    def __init__(self, worker: Executor, runner: asyncio.Future[StepRunner],
                 observe_step: Callable[[float], None] | None = None, role: str = "mixed",
                 peer_tls: ClientTLS | None = None, idle_timeout_s: float = 0.0, peer_secret: str = "",
                 kv_peers: tuple[str, ...] = (), lora_dir: str = "") -> None:
        self._worker = worker
        self._runner = runner
        self._observe_step = observe_step
        self._role = role
        self._peer_tls = peer_tls
        self._peer_secret = peer_secret
        """How this executor reaches another to pull KV blocks from it."""
        self._kv_peers = kv_peers
        """The executors it may pull KV blocks from (--kv-peers)."""
        self._lora_dir = lora_dir
        """Where LoadAdapter may read adapters (--lora-dir; empty: it is refused)."""
        self._kv_transfer: KVTransfer | None = None
        self._info: executor_pb2.ExecutorInfo | None = None
        self._facts: ExecutorInfo | None = None
        """The runner's bounds every plan is checked against (step_guard.py)."""
        self.idle_timeout_s = idle_timeout_s
        """A Step session that sends nothing this long is ended (0 = never; step_guard.py)."""
        self._active_session: int | None = None
        self._sessions_started = 0
        self._grammar_worker: ThreadPoolExecutor | None = None

    def _require_runner(self) -> StepRunner:
        if not self._runner.done():
            raise UnavailableError("the executor is still loading its model; retry once health reports SERVING")
        return self._runner.result()

    async def GetExecutorInfo(
        self, request: executor_pb2.GetExecutorInfoRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ExecutorInfo:
        runner = self._require_runner()
        if self._info is None:
            self._info = executor_info_to_proto(replace(runner.info(), role=self._role))
        return self._info

    async def PullKVBlocks(
        self, request: executor_pb2.PullKVBlocksRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.PullKVBlocksResponse:
        # The repeated fields as they are: their lengths are checked before anything is copied.
        report = await self._transfer().pull(request.source_address, request.source_block_ids, request.block_ids,
                                             request.grant)
        _log.info("kv_pulled", source=request.source_address, blocks=report.num_blocks, bytes=report.num_bytes,
                  ms=round(report.seconds * 1000, 3))
        return executor_pb2.PullKVBlocksResponse(num_blocks=report.num_blocks, num_bytes=report.num_bytes,
                                                 seconds=report.seconds)

    async def ReadKVBlocks(
        self, request: executor_pb2.ReadKVBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[executor_pb2.KVBlockChunk]:
        async for first, count, layers in self._transfer().read(request.kv_layout, request.block_ids, request.grant):
            yield executor_pb2.KVBlockChunk(first=first, count=count, layers=layers)

    async def GrantKVBlocks(
        self, request: executor_pb2.GrantKVBlocksRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.GrantKVBlocksResponse:
        return executor_pb2.GrantKVBlocksResponse(grant=self._transfer().grant(request.block_ids))

    async def RevokeKVBlocks(
        self, request: executor_pb2.RevokeKVBlocksRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.RevokeKVBlocksResponse:
        self._transfer().revoke(request.grant)
        return executor_pb2.RevokeKVBlocksResponse()

    async def PrepareGrammar(
        self, request: executor_pb2.PrepareGrammarRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.PrepareGrammarResponse:
        # On a thread of its own, beside the step worker: a new grammar's matcher and first
        # mask are built before any step runs its sequence (runtime/sampling/grammar.py).
        grammars = getattr(self._require_runner(), "grammars", None)
        if grammars is None:
            return executor_pb2.PrepareGrammarResponse()
        if self._grammar_worker is None:
            self._grammar_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-prepare")
        error = await asyncio.get_running_loop().run_in_executor(self._grammar_worker, grammars.prepare,
                                                                 request.grammar)
        return executor_pb2.PrepareGrammarResponse(error=error)

    async def LoadAdapter(self, request: executor_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext):
        """Read and check a PEFT adapter (on a thread: its files may be large) and serve it;
        INVALID_ARGUMENT naming the file and field when it cannot be served here."""
        runner = self._require_runner()
        path = resolve_in_lora_dir(self._lora_dir, request.path)
        try:
            info = await asyncio.get_running_loop().run_in_executor(None, runner.load_adapter, request.name, path)
        except ValueError as exc:  # AdapterError, and a bad NAME
            raise InvalidArgumentError(str(exc)) from None
        self._info = None  # its report lists the adapters
        return adapter_to_proto(info)

    async def UnloadAdapter(self, request: executor_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext):
        found = self._require_runner().unload_adapter(request.name)
        self._info = None
        return executor_pb2.UnloadAdapterResponse(found=found)

    def _transfer(self) -> KVTransfer:
        """The KV copies' side of this executor (services/executor/kv_transfer.py), once loaded."""
        if self._kv_transfer is None:
            runner = self._require_runner()
            info = runner.info()
            loop = asyncio.get_running_loop()
            self._kv_transfer = KVTransfer(
                runner.kv_cache, info.kv_layout, info.kv_cache_bytes // info.num_blocks, info.num_blocks,
                lambda fn, *args: loop.run_in_executor(self._worker, fn, *args), self._peer_tls,
                self._peer_secret, self._kv_peers)
        return self._kv_transfer

    async def Step(
        self, request_iterator: AsyncIterator[executor_pb2.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[executor_pb2.StepResponse]:
        runner = self._require_runner()
        if self._active_session is not None:
            raise StepSessionBusyError(
                f"another Step stream (session {self._active_session}) is driving this executor; "
                "it serves one scheduler at a time, so close that stream first"
            )
        self._sessions_started += 1
        session = self._sessions_started
        self._active_session = session
        # The finally below covers ends the generator sees; the callback covers a call that
        # ends while the generator is suspended and never resumed.
        context.add_done_callback(lambda _context: self._end_session(session))
        steps: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self._submit_steps(session, request_iterator, runner, steps),
                                     name=f"executor-step-reader-{session}")
        try:
            with logged_stream(_log, "step", context, counters=("steps",), rpc="Step", step_session=session) as stream:
                while (item := await steps.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    future, counted = item
                    result = await future
                    if counted:
                        stream.add(steps=1)
                    yield result_to_proto(result)
        finally:
            reader.cancel()
            self._end_session(session)

    async def _submit_steps(self, session: int, request_iterator: AsyncIterator[executor_pb2.StepRequest],
                            runner: StepRunner, steps: asyncio.Queue) -> None:
        """Decode each plan as it arrives and queue it on the worker at once, then hand its
        future to the handler, which answers in order (None ends, an exception fails the stream).

        A scheduler that overlaps steps sends plan N+1 while step N runs: queued on the worker
        behind step N, it starts the moment step N ends instead of after step N's result is
        encoded and sent and plan N+1 read (about a millisecond of event-loop work here).
        """
        loop = asyncio.get_running_loop()
        if self._facts is None:
            self._facts = runner.info()
        try:
            async for request in idle_limited(request_iterator, self.idle_timeout_s):
                if self._active_session != session:
                    return  # the session ended: its cleanup is queued, nothing may follow it
                plan = plan_from_proto(request)
                check_plan(plan, self._facts)  # before anything of it reaches the worker
                if plan.is_empty and not plan.finished_seq_ids:
                    # Nothing to run (the scheduler's session handshake): answer without a trip
                    # to the worker, and without counting a step.
                    done = loop.create_future()
                    done.set_result(StepResult(plan.step_id))
                    steps.put_nowait((done, False))
                    continue
                steps.put_nowait((loop.run_in_executor(self._worker, self._execute, runner, plan), True))
        except Exception as exc:  # noqa: BLE001 - a plan that does not decode, a broken stream
            steps.put_nowait(exc)
            return
        steps.put_nowait(None)

    def _execute(self, runner: StepRunner, plan: StepPlan) -> StepResult:
        """One step, in the worker thread; timed when there is a histogram to observe."""
        if self._observe_step is None:
            return runner.execute(plan)
        start = time.perf_counter()
        try:
            return runner.execute(plan)
        finally:
            self._observe_step(time.perf_counter() - start)

    def _end_session(self, session: int) -> None:
        """Forget every sequence of `session`, once, in the worker thread after its last step."""
        if self._active_session != session:
            return
        self._active_session = None
        if self._kv_transfer is not None:
            self._kv_transfer.revoke_all()  # the blocks they named belong to the next scheduler
        try:
            self._worker.submit(self._runner.result().sequences.clear)
        except RuntimeError:
            pass  # the worker was shut down with the server; the state goes with the process
