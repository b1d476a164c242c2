"""The scheduler core: a pure-Python state machine (no I/O, no torch, no clock)."""

from services.scheduler.core.block_manager import BlockManager, hash_block_tokens
from services.scheduler.core.config import SchedulerConfig, SchedulerLimits
from services.scheduler.core.free_block_queue import FreeBlockQueue, KVBlock
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.core.waiting_queue import QueueFullError, WaitingQueue

__all__ = [
    "BlockManager",
    "FreeBlockQueue",
    "KVBlock",
    "QueueFullError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerLimits",
    "SchedulerStats",
    "WaitingQueue",
    "hash_block_tokens",
]
