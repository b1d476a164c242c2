"""Where requests enter the engine core in the service: refused while the server stops or no
executor takes new requests, their deltas on a queue the Generate handler reads."""

from __future__ import annotations

import asyncio

from services.common.errors import UnavailableError
from services.common.sampling_params import SamplingParams
from services.scheduler.engine.core import EXECUTOR_UNAVAILABLE, EngineCore
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.stop import StopConditions

SHUTTING_DOWN = "the server is shutting down"


class RequestEntry:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.stopping = False
        """Set when the server begins to stop: from then on every request is refused."""

    def unavailable_reason(self) -> str | None:
        """Why no request can be accepted now (the server stops, no executor takes new
        requests); None if one can."""
        if self.stopping:
            return SHUTTING_DOWN
        if not any(lane.port.connected for lane in self.core.lanes.values()):
            return EXECUTOR_UNAVAILABLE
        return None

    def check_accepting(self) -> None:
        """Raise UnavailableError while the server stops or the executor is away (restarting)."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise UnavailableError(reason)

    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, stop: StopConditions,
               priority: int, num_speculative_tokens: int | None = None, tenant: str = "",
               cache_scope: str = "", adapter: str = "") -> asyncio.Queue[GenerationDelta]:
        """Admit a request (EngineCore.submit, which names what it raises); its deltas arrive on
        the queue returned, the last one finished."""
        self.check_accepting()
        queue: asyncio.Queue[GenerationDelta] = asyncio.Queue()
        self.core.submit(request_id, prompt_ids, sampling, stop, queue.put_nowait, priority,
                         num_speculative_tokens, tenant, cache_scope, adapter)
        return queue

    async def prepare_grammar(self, grammar: str) -> str:
        """Have every executor that can build ``grammar``'s matcher and first mask now, at
        admission, so no step pays for it: "" when ready, else the first executor's reason."""
        ports = [lane.port for lane in self.core.lanes.values() if hasattr(lane.port, "prepare_grammar")]
        errors = await asyncio.gather(*(port.prepare_grammar(grammar) for port in ports))
        return next((error for error in errors if error), "")

    def abort(self, request_id: str) -> bool:
        """Abort a request (client cancelled or Abort RPC); its blocks are freed now."""
        return self.core.abort(request_id) is not None
