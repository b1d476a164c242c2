"""The public Generation API: a thin adapter between protobuf and the scheduler loop.

A Generate's fields are taken by the intake (intake.py), its life from the door to its last
delta is a GenerateCall (generate_call.py), its deltas become messages in generation_codec.py.
"""

from __future__ import annotations

from services.common.metrics import TenantMetrics
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.scheduler.admission import Admission
from services.scheduler.auth import AuthTable, current_tenant
from services.scheduler.generate_call import GenerateCalls, scoped_request_id
from services.scheduler.generation_codec import delta_to_protos, model_info_to_proto, profile_to_proto
from services.scheduler.intake import GenerateIntake
from services.common.latency_profile import LatencyProfileRecorder
from services.scheduler.profile_cache import ProfileCache
from services.scheduler.request_limits import RequestLimits
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.structured.grammar_compiler import GrammarCompiler
from services.scheduler.supervisor import Supervisor


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, supervisor: Supervisor, admission: Admission, *, max_prompt_chars: int = 0,
                 profile: LatencyProfileRecorder | None = None, model_name: str = "",
                 tenant_metrics: TenantMetrics | None = None, auth_table: AuthTable | None = None,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        self.supervisor = supervisor
        self.calls = GenerateCalls(supervisor, admission, auth_table, tenant_metrics)
        self.profile = profile
        self._profiles = ProfileCache(profile) if profile is not None else None
        """GetProfile's snapshots, cached and capped (profile_cache.py)."""
        self.model_name = model_name
        self.grammar_compiler = grammar_compiler or GrammarCompiler(SchedulerLimits().max_grammar_bytes)
        """Structured outputs, compiled at admission off the event loop (in the service, on its
        compile worker processes) and cached by content."""
        self.intake = GenerateIntake(supervisor, self.grammar_compiler, max_prompt_chars, model_name)

    def limits(self) -> RequestLimits:
        return self.intake.limits()

    async def Generate(self, request, context):
        tenant = current_tenant.get()  # set by the auth interceptor; None without authentication
        call = self.calls.open(request.request_id, tenant, request.fairness_key)
        try:
            intake = await self.intake.take(request, tenant, call.share)
            salt, adapter = request.cache_salt, request.adapter
            # The stream may last minutes: hold what was taken, not the message (the server's own
            # reference goes with RequestRelease, request_release.py).
            del request
            prompt_tokens = call.submit(intake, self.intake.most_tokens(intake), salt, adapter)
            del intake
            try:
                yield generation_pb2.GenerateResponse(
                    started=generation_pb2.Started(request_id=call.request_id, prompt_tokens=prompt_tokens))
                while (item := await call.next_delta()) is not None:
                    for message in delta_to_protos(item):
                        yield message
            finally:
                call.end()
        finally:
            call.leave()

    async def Abort(self, request, context):
        # Scoped to the caller: another tenant's request is as unknown as a made-up id.
        key = scoped_request_id(current_tenant.get(), request.request_id)
        return generation_pb2.AbortResponse(found=self.supervisor.abort(key))

    async def GetModelInfo(self, request, context):
        tokenizer = self.supervisor.tokenizers.info
        return model_info_to_proto(self.intake.executor_info(), self.model_name, self.supervisor.core.eos_token_ids,
                                   tokenizer.tool_call_format if tokenizer is not None else "",
                                   self.supervisor.core.adapters.all())

    async def GetProfile(self, request, context):
        if self.profile is None:
            raise NotImplementedError("latency profiles are not enabled on this scheduler")
        window = request.window_seconds if request.HasField("window_seconds") else None
        core = self.supervisor.core
        executors = [(name, lane.role, lane.scheduler.get_stats(), core.handoff.counters.get(name))
                     for name, lane in core.lanes.items()]
        return profile_to_proto(self._profiles.snapshot(window), core.stats(), executors)
