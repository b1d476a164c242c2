"""The Generation API's protobuf edge: request fields to domain values, deltas to responses.

The servicer (servicer.py) calls these and nothing past it sees a protobuf message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import PurePath

from services.common.adapters import AdapterInfo
from services.common.codec.step_codec import adapter_to_proto
from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.common.step import ExecutorInfo
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.stop import StopConditions
from services.scheduler.structured.structured_output import StructuredOutput

FINISH_REASON_TO_PROTO = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def stop_from_proto(msg: common_pb2.StopConditions) -> StopConditions:
    return StopConditions(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
    )


def structured_output_from_proto(request: generation_pb2.GenerateRequest) -> StructuredOutput | None:
    """The request's structured output; None when it has none (or an empty one)."""
    if not request.HasField("structured_output"):
        return None
    msg = request.structured_output
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutput.json_schema(msg.json_schema)
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "regex":
        return StructuredOutput.regex(msg.regex)
    if kind == "choice":
        return StructuredOutput.choice(tuple(msg.choice.options))
    return StructuredOutput.grammar(msg.grammar)


def delta_to_protos(delta: GenerationDelta) -> list[generation_pb2.GenerateResponse]:
    out = []
    if delta.text or delta.token_ids:
        d = generation_pb2.Delta(text=delta.text, token_ids=delta.token_ids)
        for lp in delta.logprobs or ():
            d.logprobs.add(token_id=0, logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                           top_logprobs=lp.top_logprobs)
        for lp, token_id in zip(d.logprobs, delta.token_ids):
            lp.token_id = token_id
        for token_id, lp in delta.prompt_logprobs or ():
            d.prompt_logprobs.add(token_id=token_id, logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                                  top_logprobs=lp.top_logprobs)
        out.append(generation_pb2.GenerateResponse(delta=d))
    if delta.finished:
        out.append(generation_pb2.GenerateResponse(finished=_finished_to_proto(delta)))
    return out


def _finished_to_proto(delta: GenerationDelta) -> generation_pb2.Finished:
    f = generation_pb2.Finished(finish_reason=FINISH_REASON_TO_PROTO[delta.finish_reason])
    if delta.stop_reason is not None:
        f.stop_reason = str(delta.stop_reason)
    if delta.error_message is not None:
        f.error_message = delta.error_message
    if delta.usage is not None:
        f.usage.prompt_tokens = delta.usage.prompt_tokens
        f.usage.completion_tokens = delta.usage.completion_tokens
        f.usage.cached_tokens = delta.usage.cached_tokens
    if delta.timings is not None:
        t = delta.timings
        f.timings.queue_time_ms = t.queue_time_ms
        f.timings.time_to_first_token_ms = t.time_to_first_token_ms
        f.timings.decode_time_ms = t.decode_time_ms
        f.timings.e2e_ms = t.e2e_ms
        f.timings.accepted_draft_tokens = t.accepted_draft_tokens
    return f


def model_info_to_proto(info: ExecutorInfo, model_name: str, eos_token_ids,
                        tool_call_format: str = "", adapters: Sequence[AdapterInfo] = ()) -> generation_pb2.ModelInfo:
    """GetModelInfo's answer; ``tool_call_format``: the tokenizer's chat template's tool syntax;
    ``adapters``: those requests may name (their paths are not told)."""
    msg = generation_pb2.ModelInfo(
        model_name=model_name, model_path=PurePath(info.model).name, architecture=info.architecture,
        vocab_size=info.vocab_size, max_model_len=info.max_model_len, num_kv_blocks=info.num_blocks,
        block_size=info.block_size, dtype=info.dtype, device=info.device,
        attention_backend=info.attention_backend, eos_token_ids=list(eos_token_ids),
        kv_cache_dtype=info.kv_cache_dtype, kv_cache_tokens=info.kv_cache_tokens,
        kv_cache_bytes=info.kv_cache_bytes, tool_call_format=tool_call_format,
        adapters=[adapter_to_proto(dataclasses.replace(adapter, path="")) for adapter in adapters])
    if info.bos_token_id is not None:
        msg.bos_token_id = info.bos_token_id
    return msg


def profile_to_proto(snap, stats, executors) -> generation_pb2.LatencyProfile:
    """GetProfile's answer: a LatencySnapshot of the window, the engine's live gauges
    (``stats``: SchedulerStats, None while no executor is connected) and each executor's
    (``executors``: (name, role, SchedulerStats, TransferCounters or None))."""
    msg = generation_pb2.LatencyProfile(
        window_seconds=snap.window_s, num_requests=snap.num_requests,
        ttft_p50_ms=snap.ttft_p50_ms, ttft_p99_ms=snap.ttft_p99_ms,
        tpot_p50_ms=snap.tpot_p50_ms, tpot_p99_ms=snap.tpot_p99_ms,
        tokens_per_second_per_stream=snap.tokens_per_s_per_stream,
        tokens_per_second_total=snap.tokens_per_s_total,
        max_output_tokens=snap.max_output_tokens)
    if stats is not None:
        msg.kv_cache_usage = stats.kv_cache_usage
        msg.num_running = stats.num_running
        msg.num_waiting = stats.num_waiting
        msg.spec_mean_accepted_length = stats.spec_decode.mean_accepted_length
        msg.spec_acceptance_rate = stats.spec_decode.acceptance_rate
    for name, role, lane_stats, copies in executors:
        entry = msg.executors.add(name=name, role=role, kv_cache_usage=lane_stats.kv_cache_usage,
                                  num_running=lane_stats.num_running, num_waiting=lane_stats.num_waiting)
        if copies is not None:
            entry.kv_transfers, entry.kv_transfer_bytes = copies.transfers, copies.bytes
            entry.kv_transfer_seconds, entry.kv_transfer_failures = copies.seconds, copies.failures
    return msg
