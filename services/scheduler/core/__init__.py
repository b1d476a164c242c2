"""The scheduler core: a pure-Python state machine (no I/O, no torch, no clock)."""

from services.scheduler.core.block_manager import BlockManager, hash_block_tokens
from services.scheduler.core.config import SchedulerConfig, SchedulerLimits
from services.scheduler.core.free_block_queue import FreeBlockQueue, KVBlock
from services.scheduler.core.outputs import RequestUpdate, SchedulerStats
from services.scheduler.core.request import FinishReason, Request, RequestStatus
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.waiting_queue import QueueFullError, WaitingQueue

__all__ = [
    "BlockManager",
    "FinishReason",
    "FreeBlockQueue",
    "KVBlock",
    "QueueFullError",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerLimits",
    "SchedulerStats",
    "WaitingQueue",
    "hash_block_tokens",
]
