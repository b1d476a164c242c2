"""Scheduler service entry point: ``python -m services.scheduler`` / ``tokenmill serve scheduler``."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import structlog

from services.common.malloc import cap_arenas, trim_when_idle
from services.common.metrics import request_metrics, scheduler_collector, tenant_metrics
from services.common.pb.tokenmill.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer
from services.common.service_main import announce_serving, internal_secret, registrar, service_main, start_service
from services.common.tls import ClientTLS
from services.scheduler.admin_servicer import AdminServicer
from services.scheduler.admission import Admission, DoorInterceptor, per_tenant_bound
from services.scheduler.auth import AuthInterceptor, load_auth_tokens, reload_auth
from services.scheduler.config import SchedulerServiceConfig
from services.common.latency_profile import LatencyProfileRecorder
from services.scheduler.request_release import RequestRelease
from services.scheduler.servicer import GenerationServicer
from services.scheduler.structured.compile_workers import CompileWorkers
from services.scheduler.structured.grammar_compiler import GrammarCompiler
from services.scheduler.supervisor import Backends, Supervisor


_log = structlog.get_logger("tokenmill.scheduler")

PROFILE_RETENTION_S = 600.0
"""GetProfile may ask for a window up to this long (or the configured one, if longer)."""

MALLOC_ARENAS = 2
"""glibc malloc arenas for the scheduler's threads (default: one per thread, ten here), so free
C memory is not scattered over ten arenas. Measured with the stress suite on a 2-core CPU, two
10-minute runs side by side: idle RSS growth +6.3% with two arenas against +8.4% without, and as
many streams served (65,443 and 64,137; docs/benchmarks.md, "Hardening runs"). MALLOC_ARENA_MAX in the
environment wins."""


async def serve(config: SchedulerServiceConfig) -> RunningServer:
    """Connect to the executor and tokenizers, then serve the Generation API."""
    config.validate()  # bad limits fail before anything connects or binds
    profile = LatencyProfileRecorder(config.profile.profile_window_s, retention_s=PROFILE_RETENTION_S,
                                     capacity=config.profile.profile_capacity)
    observers = [profile.on_finished]
    if config.metrics_port >= 0:
        observers.append(request_metrics().observe_finished)

    def on_finished(delta, stream) -> None:
        for observe in observers:
            observe(delta, stream)

    speculation = config.speculation
    backends = Backends(config.executor_addresses, config.tokenizer_addresses,
                        speculation.drafter_address if speculation.drafting else "",
                        speculation.spec_draft_deadline_ms / 1000, ClientTLS.for_backends(config), internal_secret(config))
    supervisor = Supervisor(config.limits, backends, config.connect_timeout_s, speculation=speculation.config(),
                            on_finished=on_finished)
    supervisor.adapter_admin.lora_dir = config.lora_dir
    await supervisor.start()
    auth_table = load_auth_tokens(config.auth_tokens_file) if config.auth_tokens_file else None
    per_tenant = per_tenant_bound(config.max_waiting_per_tenant, config.limits.max_waiting_requests,
                                  len(auth_table.tenants) if auth_table is not None else 0)
    admission = Admission(config.limits.max_waiting_requests, per_tenant)
    servicer = GenerationServicer(supervisor, admission, max_prompt_chars=config.max_prompt_chars, profile=profile,
                                  model_name=Path(next(iter(supervisor.core.lanes.values())).info.model).name,
                                  tenant_metrics=tenant_metrics() if config.metrics_port >= 0 else None,
                                  auth_table=auth_table,
                                  grammar_compiler=_grammar_compiler(config, supervisor))
    if config.metrics_port >= 0:
        scheduler_collector().watch(supervisor.core)
    auth = AuthInterceptor(auth_table) if auth_table is not None else None
    # No message larger than the largest request this model can serve (request_limits.py): a
    # body padded with unknown fields is refused before it is parsed.
    message_bytes = min(config.max_message_bytes, servicer.limits().message_bytes())
    _log.info("public_message_limit", max_message_bytes=message_bytes)
    generation = registrar(servicer, generation_pb2_grpc.add_GenerationServicer_to_server, generation_pb2, "Generation")
    admin = registrar(AdminServicer(supervisor.adapter_admin), admin_pb2_grpc.add_AdminServicer_to_server, admin_pb2,
                      "Admin")
    running = await start_service(dataclasses.replace(config, max_message_bytes=message_bytes), "scheduler",
                                  lambda server: [*generation(server), *admin(server)],
        interceptors=[RequestRelease()],
        # Authentication first (from metadata, bodies undecoded), so the door's answers (queue
        # full, executor away) reach only callers with a token.
        front_interceptors=[*([auth] if auth is not None else []),
                            DoorInterceptor(admission, unavailable=supervisor.unavailable_reason)],
        app=supervisor)
    running.on_stopping(supervisor.shutdown)
    running.on_stop(servicer.grammar_compiler.workers.close)
    if auth is not None:
        running.on_reload(lambda: reload_auth(config.auth_tokens_file, auth, [servicer.calls]))
    # Free memory back to the system once the load ends (glibc's malloc_trim; with
    # PYTHONMALLOC=malloc that includes the pages of Python objects freed after a peak).
    trimmer = asyncio.create_task(trim_when_idle(lambda: supervisor.core.step_count), name="scheduler-malloc-trim")
    running.on_stop(trimmer.cancel)
    await announce_serving(running, config)
    supervisor.health.report_to(running.set_serving)
    return running


def _grammar_compiler(config: SchedulerServiceConfig, supervisor: Supervisor) -> GrammarCompiler:
    """Structured outputs compiled on child processes; their first masks over the model's own
    vocabulary when its tokenizer.json is readable here (as with ``tokenmill up``), else over bytes."""
    model_dir = Path(next(iter(supervisor.core.lanes.values())).info.model)
    vocabulary = model_dir / "tokenizer.json"
    compile_settings = config.grammar_compile
    workers = CompileWorkers(compile_settings.grammar_compile_workers, compile_settings.grammar_compile_timeout_s,
                             compile_settings.grammar_compiles_per_tenant,
                             str(vocabulary) if vocabulary.is_file() else "")
    return GrammarCompiler(config.limits.max_grammar_bytes, workers=workers)


def main(argv: list[str] | None = None) -> int:
    cap_arenas(MALLOC_ARENAS)  # before gRPC starts its threads, each of which would get an arena
    return service_main("scheduler", SchedulerServiceConfig, serve, argv)
