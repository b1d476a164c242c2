"""DetokenizeBatch / DetokenizeResult <-> tokenizer.proto DetokenizeRequest / DetokenizeResponse.

Protobuf stays at the edge: the scheduler's tokenizer link and the tokenizer's servicer call
these; both sides otherwise speak services/common/detokenize.py. Every step's tokens cross
here, so streams travel as packed parallel arrays, as the step codec does.
"""

from __future__ import annotations

from services.common.codec.packed import split_packed
from services.common.detokenize import DetokenizeBatch, DetokenizeResult, NewTextStream
from services.common.pb.tokenmill.v1 import tokenizer_pb2


def batch_to_proto(batch: DetokenizeBatch, step_id: int) -> tokenizer_pb2.DetokenizeRequest:
    msg = tokenizer_pb2.DetokenizeRequest(step_id=step_id)
    for new in batch.new_streams:
        msg.new_streams.add(stream_id=new.stream_id, prompt_token_ids=new.prompt_tail,
                            skip_special_tokens=new.skip_special_tokens,
                            stop=new.stop, include_stop_str_in_output=new.include_stop_str_in_output)
    stream_ids, counts, flat = [], [], []
    for stream_id, ids in batch.appended:
        stream_ids.append(stream_id)
        counts.append(len(ids))
        flat.extend(ids)
    msg.stream_ids.extend(stream_ids)
    msg.token_counts.extend(counts)
    msg.token_ids.extend(flat)
    msg.closed_stream_ids.extend(batch.closed)
    return msg


def batch_from_proto(msg: tokenizer_pb2.DetokenizeRequest) -> DetokenizeBatch:
    """Raises InvalidArgumentError naming the field of a malformed message."""
    new_streams = [NewTextStream(new.stream_id, list(new.prompt_token_ids), tuple(new.stop),
                                 new.include_stop_str_in_output, new.skip_special_tokens) for new in msg.new_streams]
    appended = split_packed(msg.stream_ids, msg.token_counts, msg.token_ids,
                            ids_field="stream_ids", counts_field="token_counts", flat_field="token_ids")
    return DetokenizeBatch(new_streams, appended, list(msg.closed_stream_ids))


def result_to_proto(result: DetokenizeResult, step_id: int) -> tokenizer_pb2.DetokenizeResponse:
    texts, stopped, failed = result.texts, result.stopped, result.failed
    return tokenizer_pb2.DetokenizeResponse(step_id=step_id, stream_ids=list(texts), text_deltas=list(texts.values()),
                                            stopped_stream_ids=list(stopped), stopped_strings=list(stopped.values()),
                                            failed_stream_ids=list(failed), failed_reasons=list(failed.values()))


def result_from_proto(msg: tokenizer_pb2.DetokenizeResponse) -> DetokenizeResult:
    return DetokenizeResult(dict(zip(msg.stream_ids, msg.text_deltas)),
                            dict(zip(msg.stopped_stream_ids, msg.stopped_strings)),
                            dict(zip(msg.failed_stream_ids, msg.failed_reasons)))
