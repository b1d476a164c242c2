"""Prefill/decode disaggregation: a prompt computed on a prefill executor continues on a decode
executor, its KV blocks copied between them directly.

After the update that brings a request's first token on a prefill executor, the request
leaves that executor's scheduler with its blocks still held there (``detach_request``), and
a decode executor is chosen (placement.py). Its scheduler allocates blocks for every token
but the last, reusing what its own prefix cache holds (those blocks are not sent again); the
decode executor then pulls the rest from the prefill executor (the executor service's
PullKVBlocks, which checks both pools' layout first). Meanwhile the request is held here,
in neither scheduler. The prefill executor serves only the blocks the scheduler granted for
this copy (GrantKVBlocks; the grant is revoked before those blocks are released, so no later
read reaches what they hold next). Once the copy is done the prefill side frees its blocks and the request
joins the decode scheduler with those tokens computed, so its next step is a decode. A copy
that fails (either executor lost, a layout mismatch, a timeout) frees what it took and the
request recomputes its prompt on the decode side: the output is the same, only slower.

With no decode executor attached, a request simply decodes where its prompt was computed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from services.scheduler.engine.placement import ROLES_FOR_DECODE, choose_lane
from services.scheduler.request.request import Request
from services.scheduler.engine.request_table import RequestTable
from services.scheduler.request.update import RequestUpdate

if TYPE_CHECKING:
    from services.scheduler.engine.lane import ExecutorLane

_log = structlog.get_logger("tokenmill.scheduler")

TRANSFER_TIMEOUT_S = 30.0
"""A copy slower than this is abandoned (the request recomputes on the decode side)."""


@dataclass(slots=True)
class TransferCounters:
    """KV copies into one decode executor, since start."""

    transfers: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    """Copies that failed and fell back to recompute."""
    reused_blocks: int = 0
    """Blocks the decode side's prefix cache already held, so not sent."""


@dataclass(frozen=True, slots=True)
class HandoffContext:
    """What a hand-off needs of its engine: no more, so the engine core is not a dependency."""

    lanes: Mapping[str, ExecutorLane]
    """The attached executors by name, live: a lane dropped meanwhile is gone from it."""
    requests: RequestTable
    requeue: Callable[[Request], object]
    """Queue a request that left its executor on another (a failed copy recomputes there)."""


class KVCopier:
    """Copies a request's KV blocks from a prefill executor's pool to a decode executor's."""

    def __init__(self) -> None:
        self.counters: dict[str, TransferCounters] = {}
        """By decode executor name."""

    @staticmethod
    async def _revoke(source: ExecutorLane, grant: str) -> None:
        """End the copy's grant before its blocks are released (a read that spent it already
        ended it too); an executor that does not answer is gone, its grants with it."""
        try:
            await source.port.revoke_kv(grant)
        except Exception as exc:  # noqa: BLE001 - the copy's outcome stands either way
            _log.warning("kv_grant_not_revoked", source=source.name, error=str(exc))

    async def copy(self, request: Request, source: ExecutorLane, held: list[int], target: ExecutorLane) -> bool:
        """Copy the KV of every token but the last into ``target``'s pool; True when done
        (``request`` then holds its blocks there, those tokens computed)."""
        counters = self.counters.setdefault(target.name, TransferCounters())
        if source.info.kv_layout != target.info.kv_layout or not source.info.kv_layout:
            counters.failures += 1
            return False  # pools of different layouts: the decode side recomputes the prompt
        manager = target.scheduler.block_manager
        if any(manager.windows.group_windows):
            # Sliding-window tables, whose entries behind the window the source gave back: not
            # copied as a run of blocks; the decode side recomputes the prompt.
            counters.failures += 1
            return False
        num_tokens = request.num_tokens - 1
        hit_ids, hit_tokens = manager.prefixes.get_computed_blocks(request)
        if manager.allocate_slots(request, num_tokens - hit_tokens, hit_ids) is None:
            counters.failures += 1
            return False  # no room on the decode side now: it waits there and recomputes
        size = manager.block_size
        needed = -(-num_tokens // size)
        source_ids, target_ids = held[len(hit_ids):needed], request.block_ids[len(hit_ids):needed]
        started = time.perf_counter()
        grant = ""
        try:
            grant = await asyncio.wait_for(source.port.grant_kv(source_ids), TRANSFER_TIMEOUT_S)
            report = await asyncio.wait_for(target.port.pull_kv(source.name, grant, source_ids, target_ids),
                                            TRANSFER_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure falls back to recompute
            _log.warning("kv_transfer_failed", request_id=request.request_id, source=source.name,
                         target=target.name, error=str(exc))
            counters.failures += 1
            return False
        finally:
            if grant:
                await self._revoke(source, grant)
        counters.transfers += 1
        counters.blocks += report.num_blocks
        counters.bytes += report.num_bytes
        counters.seconds += time.perf_counter() - started
        counters.reused_blocks += len(hit_ids)
        request.num_computed_tokens = num_tokens
        return True


class Handoff:
    def __init__(self, context: HandoffContext) -> None:
        self._context = context
        self._moving: dict[str, asyncio.Task] = {}
        self._copier = KVCopier()
        self.counters = self._copier.counters
        """By decode executor name."""

    @property
    def num_moving(self) -> int:
        return len(self._moving)

    def after_update(self, lane: ExecutorLane, updates: list[RequestUpdate]) -> None:
        """Hand the requests whose first token this prefill executor just produced to a decode one."""
        if lane.role != "prefill":
            return
        decoders = [other for other in self._context.lanes.values() if other.role in ROLES_FOR_DECODE]
        if not decoders:
            return
        for update in updates:
            request = lane.scheduler.requests.get(update.request_id)
            if update.finish_reason is not None or request is None:
                continue
            if request.num_output_tokens != len(update.new_token_ids):
                continue  # not its first tokens: it already decodes here
            target = choose_lane(request, decoders, ROLES_FOR_DECODE)
            held = lane.scheduler.detach_request(request.request_id)
            self._moving[request.request_id] = asyncio.create_task(
                self._move(request, lane, held, target), name=f"kv-handoff-{request.request_id}")

    def forget(self, request_id: str) -> None:
        """The request ended (abort, stop string, error) while it moved: the move gives up."""
        task = self._moving.get(request_id)
        if task is not None:
            task.cancel()

    async def _move(self, request: Request, source: ExecutorLane, held: list[int], target: ExecutorLane) -> None:
        try:
            copied = await self._copier.copy(request, source, held, target)
        except asyncio.CancelledError:
            target.scheduler.block_manager.free(request)
            raise
        finally:
            self._moving.pop(request.request_id, None)
            if self._context.lanes.get(source.name) is source:
                source.scheduler.block_manager.pool.release(held)
                source.wake()
        context = self._context
        if context.requests.get(request.request_id) is None:  # ended meanwhile
            target.scheduler.block_manager.free(request)
            return
        if copied and context.lanes.get(target.name) is target:
            target.scheduler.add_request(request, moved=True)
            target.wake()
            return
        if context.lanes.get(target.name) is target:
            target.scheduler.block_manager.free(request)
        request.leave_executor()
        context.requeue(request)
