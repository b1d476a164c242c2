"""StepPlan / StepResult <-> executor.proto StepRequest / StepResponse, and SamplingParams.

Protobuf stays at the edge: the scheduler and the executor speak the dataclasses of
services/common/step.py; only their gRPC adapters call these functions.

Speed matters because this runs twice per step on each side of the hop. Running sequences
and outputs travel as packed parallel arrays (one repeated field per attribute, ragged lists
flattened with a count per row), so a 256-sequence decode step is a handful of repeated
fields instead of 256 sub-messages. Encoding builds plain Python lists with append/extend
and hands them to the message constructor in one call; decoding copies each repeated field
into a list once (indexing a protobuf container element by element is several times
slower) and slices it with running offsets.

Lossy corners, on purpose:
- logprobs travel as float32 (the sampler computes them in float32, so nothing is lost in
  practice; a Python float that is not float32-representable comes back rounded).
- an output whose logprobs is an empty list comes back as None (count 0 means "none").
"""

from __future__ import annotations

import math

from itertools import accumulate

from services.common.adapters import AdapterInfo
from services.common.errors import InvalidArgumentError
from services.common.pb.tokenmill.v1 import common_pb2, executor_pb2
from services.common.sampling_params import SamplingParams
from services.common.step import MinTokensBan
from services.common.step import (
    ExecutorInfo,
    NewSequence,
    RunningSequence,
    SequenceOutput,
    StepPlan,
    StepResult,
    TokenLogprobs,
)

__all__ = [
    "plan_from_proto",
    "plan_to_proto",
    "result_from_proto",
    "result_to_proto",
    "sampling_from_proto",
    "sampling_to_proto",
]

_DEFAULT_SAMPLING = SamplingParams()


# --- sampling ------------------------------------------------------------------------------


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field is written explicitly, so the receiver never falls back to a default."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=params.logit_bias,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Absent optional fields take the SamplingParams defaults (temperature 1.0, not greedy)."""
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else _DEFAULT_SAMPLING.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else _DEFAULT_SAMPLING.top_p,
        min_p=msg.min_p,
        repetition_penalty=(
            msg.repetition_penalty
            if msg.HasField("repetition_penalty")
            else _DEFAULT_SAMPLING.repetition_penalty
        ),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=dict(msg.logit_bias),
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


# --- StepPlan <-> StepRequest --------------------------------------------------------------


def _new_sequence_to_proto(seq: NewSequence) -> executor_pb2.NewSequence:
    # The ban travels as the proto's min_tokens / stop_token_ids beside sampling; no ban is 0 / [].
    ban = seq.min_tokens_ban
    return executor_pb2.NewSequence(
        seq_id=seq.seq_id,
        token_ids=seq.token_ids,
        prompt_len=seq.prompt_len,
        num_computed_tokens=seq.num_computed_tokens,
        num_scheduled_tokens=seq.num_scheduled_tokens,
        block_ids=seq.block_ids,
        sampling=sampling_to_proto(seq.sampling),
        min_tokens=ban.min_tokens if ban is not None else 0,
        stop_token_ids=ban.token_ids if ban is not None else (),
        grammar=seq.sampling.grammar or "",
        adapter=seq.adapter,
    )


def _new_sequence_from_proto(msg: executor_pb2.NewSequence) -> NewSequence:
    return NewSequence(
        seq_id=msg.seq_id,
        token_ids=list(msg.token_ids),
        prompt_len=msg.prompt_len,
        num_computed_tokens=msg.num_computed_tokens,
        num_scheduled_tokens=msg.num_scheduled_tokens,
        block_ids=list(msg.block_ids),
        sampling=_with_grammar(sampling_from_proto(msg.sampling), msg.grammar),
        min_tokens_ban=(
            MinTokensBan(msg.min_tokens, tuple(msg.stop_token_ids))
            if msg.min_tokens > 0 and msg.stop_token_ids
            else None
        ),
        adapter=msg.adapter,
    )


def _with_grammar(sampling: SamplingParams, grammar: str) -> SamplingParams:
    # The grammar rides beside the sampling message (the public SamplingParams has no such
    # field: only admission sets it, after compiling the request's StructuredOutput).
    sampling.grammar = grammar or None
    return sampling


def plan_to_proto(plan: StepPlan) -> executor_pb2.StepRequest:
    running = plan.running
    block_counts: list[int] = []
    block_ids: list[int] = []
    draft_counts: list[int] = []
    draft_ids: list[int] = []
    for seq in running:
        new_blocks = seq.new_block_ids
        block_counts.append(len(new_blocks))
        if new_blocks:
            block_ids.extend(new_blocks)
        drafts = seq.draft_token_ids
        draft_counts.append(len(drafts))
        if drafts:
            draft_ids.extend(drafts)
    return executor_pb2.StepRequest(
        step_id=plan.step_id,
        new_sequences=[_new_sequence_to_proto(seq) for seq in plan.new],
        running_seq_ids=[seq.seq_id for seq in running],
        running_num_scheduled_tokens=[seq.num_scheduled_tokens for seq in running],
        running_new_block_counts=block_counts,
        running_new_block_ids=block_ids,
        running_draft_counts=draft_counts,
        running_draft_token_ids=draft_ids,
        finished_seq_ids=plan.finished_seq_ids,
        # Empty in the common case: every sequence runs one step.
        running_num_steps=[seq.num_steps for seq in running] if any(seq.num_steps != 1 for seq in running) else [],
    )


def _check_parallel(field: str, values: list, expected_len: int, per: str = "sequence") -> None:
    if len(values) != expected_len:
        raise InvalidArgumentError(f"{field} has {len(values)} entries; expected {expected_len} (one per {per})")


def _check_flat(flat_field: str, flat_len: int, counts_field: str, counts: list[int]) -> None:
    total = sum(counts)
    if total != flat_len or (counts and min(counts) < 0):
        raise InvalidArgumentError(
            f"{flat_field} has {flat_len} entries but {counts_field} sums to {total}"
            + (" and has negative entries" if counts and min(counts) < 0 else "")
        )


def _split(flat: list, counts: list[int]) -> list[list]:
    """Cut a flat array into consecutive pieces of the given lengths (sum(counts) == len(flat))."""
    if not flat:  # the common decode step: no new blocks, no drafts
        return [[] for _ in counts]
    ends = accumulate(counts)
    return [flat[end - count : end] for count, end in zip(counts, ends)]


def plan_from_proto(msg: executor_pb2.StepRequest) -> StepPlan:
    """Raises InvalidArgumentError when the packed arrays disagree in length."""
    seq_ids = list(msg.running_seq_ids)
    num_running = len(seq_ids)
    num_scheduled = list(msg.running_num_scheduled_tokens)
    block_counts = list(msg.running_new_block_counts)
    block_ids = list(msg.running_new_block_ids)
    draft_counts = list(msg.running_draft_counts)
    draft_ids = list(msg.running_draft_token_ids)
    _check_parallel("running_num_scheduled_tokens", num_scheduled, num_running)
    _check_parallel("running_new_block_counts", block_counts, num_running)
    _check_parallel("running_draft_counts", draft_counts, num_running)
    _check_flat("running_new_block_ids", len(block_ids), "running_new_block_counts", block_counts)
    _check_flat("running_draft_token_ids", len(draft_ids), "running_draft_counts", draft_counts)

    running = list(
        map(RunningSequence, seq_ids, num_scheduled, _split(block_ids, block_counts), _split(draft_ids, draft_counts))
    )
    if msg.running_num_steps:
        num_steps = list(msg.running_num_steps)
        _check_parallel("running_num_steps", num_steps, num_running)
        for index, (seq, steps) in enumerate(zip(running, num_steps)):
            if steps < 1 or (steps > 1 and (seq.num_scheduled_tokens != 1 or seq.draft_token_ids)):
                raise InvalidArgumentError(
                    f"running_num_steps[{index}] = {steps}: must be >= 1, and above 1 only for a sequence that "
                    f"schedules 1 token and no drafts (it has {seq.num_scheduled_tokens} and "
                    f"{len(seq.draft_token_ids)})")
            seq.num_steps = steps
    return StepPlan(
        step_id=msg.step_id,
        new=[_new_sequence_from_proto(seq) for seq in msg.new_sequences],
        running=running,
        finished_seq_ids=list(msg.finished_seq_ids),
    )


# --- StepResult <-> StepResponse -----------------------------------------------------------


def _pack_logprobs(outputs: list[SequenceOutput], which: str) -> tuple[list[int], list[float], list[int], list[int],
                                                                      list[float]]:
    """(counts per sequence, logprob per entry, top counts per entry, top ids, top logprobs) of
    each output's ``which`` list (logprobs or prompt_logprobs)."""
    counts: list[int] = []
    values: list[float] = []
    top_counts: list[int] = []
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []
    for out in outputs:
        entries = getattr(out, which)
        counts.append(len(entries) if entries else 0)
        for entry in entries or ():
            if len(entry.top_token_ids) != len(entry.top_logprobs):
                raise InvalidArgumentError(
                    f"seq {out.seq_id}: top_token_ids has {len(entry.top_token_ids)} entries "
                    f"but top_logprobs has {len(entry.top_logprobs)}"
                )
            values.append(entry.logprob)
            top_counts.append(len(entry.top_token_ids))
            top_token_ids.extend(entry.top_token_ids)
            top_logprobs.extend(entry.top_logprobs)
    return counts, values, top_counts, top_token_ids, top_logprobs


def result_to_proto(result: StepResult) -> executor_pb2.StepResponse:
    seq_ids: list[int] = []
    token_counts: list[int] = []
    token_ids: list[int] = []
    errors: dict[int, str] = {}
    for out in result.outputs:
        seq_ids.append(out.seq_id)
        if out.error is not None:
            errors[out.seq_id] = out.error
        tokens = out.token_ids
        token_counts.append(len(tokens))
        token_ids.extend(tokens)
    counts, values, top_counts, top_token_ids, top_logprobs = _pack_logprobs(result.outputs, "logprobs")
    message = executor_pb2.StepResponse(
        step_id=result.step_id,
        seq_ids=seq_ids,
        token_counts=token_counts,
        token_ids=token_ids,
        logprob_counts=counts,
        sampled_logprobs=values,
        top_counts=top_counts,
        top_token_ids=top_token_ids,
        top_logprobs=top_logprobs,
        execute_seconds=result.execute_seconds,
        errors=errors,
    )
    if any(out.prompt_logprobs for out in result.outputs):
        counts, values, top_counts, top_token_ids, top_logprobs = _pack_logprobs(result.outputs, "prompt_logprobs")
        message.prompt_logprob_counts.extend(counts)
        message.prompt_logprobs.extend(values)
        message.prompt_top_counts.extend(top_counts)
        message.prompt_top_token_ids.extend(top_token_ids)
        message.prompt_top_logprobs.extend(top_logprobs)
    return message


def _unpack_logprobs(num_seqs: int, counts: list[int], values: list[float], top_counts: list[int],
                     top_token_ids: list[int], top_logprobs: list[float],
                     prefix: str = "") -> list[list[TokenLogprobs] | None]:
    """Per sequence, its entries (None for none); raises InvalidArgumentError when the packed
    arrays disagree in length. Empty counts mean "none anywhere" (a sender that had none)."""
    if counts:
        _check_parallel(f"{prefix}logprob_counts", counts, num_seqs)
    else:
        counts = [0] * num_seqs
    _check_flat(f"{prefix}logprobs" if prefix else "sampled_logprobs", len(values), f"{prefix}logprob_counts", counts)
    _check_parallel(f"{prefix}top_counts", top_counts, len(values), per="sampled logprob")
    _check_flat(f"{prefix}top_token_ids", len(top_token_ids), f"{prefix}top_counts", top_counts)
    _check_parallel(f"{prefix}top_logprobs", top_logprobs, len(top_token_ids), per="top token id")
    if not values:
        return [None] * num_seqs
    per_token = list(map(TokenLogprobs, values, _split(top_token_ids, top_counts), _split(top_logprobs, top_counts)))
    return [rows or None for rows in _split(per_token, counts)]


def result_from_proto(msg: executor_pb2.StepResponse) -> StepResult:
    """Raises InvalidArgumentError when the packed arrays disagree in length."""
    seq_ids = list(msg.seq_ids)
    token_counts = list(msg.token_counts)
    token_ids = list(msg.token_ids)
    _check_parallel("token_counts", token_counts, len(seq_ids))
    _check_flat("token_ids", len(token_ids), "token_counts", token_counts)
    logprobs = _unpack_logprobs(len(seq_ids), list(msg.logprob_counts), list(msg.sampled_logprobs),
                                list(msg.top_counts), list(msg.top_token_ids), list(msg.top_logprobs))
    prompt = _unpack_logprobs(len(seq_ids), list(msg.prompt_logprob_counts), list(msg.prompt_logprobs),
                              list(msg.prompt_top_counts), list(msg.prompt_top_token_ids),
                              list(msg.prompt_top_logprobs), prefix="prompt_")
    outputs = [SequenceOutput(seq_id, tokens, lps, prompt_logprobs=plps)
               for seq_id, tokens, lps, plps in zip(seq_ids, _split(token_ids, token_counts), logprobs, prompt)]
    if msg.errors:
        for output in outputs:
            output.error = msg.errors.get(output.seq_id)
    execute_seconds = msg.execute_seconds
    if not math.isfinite(execute_seconds) or execute_seconds < 0:
        raise InvalidArgumentError(f"execute_seconds = {execute_seconds}: must be a finite number >= 0")
    return StepResult(step_id=msg.step_id, outputs=outputs, execute_seconds=execute_seconds)


def executor_info_to_proto(info: ExecutorInfo) -> executor_pb2.ExecutorInfo:
    message = executor_pb2.ExecutorInfo(
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        dtype=info.dtype,
        device=info.device,
        attention_backend=info.attention_backend,
        model_path=info.model,
        architecture=info.architecture,
        eos_token_ids=info.eos_token_ids,
        kv_cache_dtype=info.kv_cache_dtype,
        kv_cache_bytes=info.kv_cache_bytes,
        role=info.role,
        kv_layout=info.kv_layout,
        kv_group_windows=list(info.kv_group_windows),
        max_loras=info.max_loras,
        adapters=[adapter_to_proto(a) for a in info.adapters],
    )
    if info.bos_token_id is not None:
        message.bos_token_id = info.bos_token_id
    return message


def executor_info_from_proto(msg: executor_pb2.ExecutorInfo) -> ExecutorInfo:
    return ExecutorInfo(
        num_blocks=msg.num_blocks, block_size=msg.block_size, max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size, dtype=msg.dtype, device=msg.device, attention_backend=msg.attention_backend,
        model=msg.model_path, architecture=msg.architecture,
        bos_token_id=msg.bos_token_id if msg.HasField("bos_token_id") else None,
        eos_token_ids=tuple(msg.eos_token_ids),
        kv_cache_dtype=msg.kv_cache_dtype, kv_cache_bytes=msg.kv_cache_bytes,
        role=msg.role or "mixed", kv_layout=msg.kv_layout,
        kv_group_windows=tuple(msg.kv_group_windows) or (0,),
        max_loras=msg.max_loras, adapters=tuple(adapter_from_proto(a) for a in msg.adapters),
    )


def adapter_to_proto(adapter: AdapterInfo) -> common_pb2.AdapterInfo:
    return common_pb2.AdapterInfo(name=adapter.name, path=adapter.path, rank=adapter.rank, alpha=adapter.alpha,
                                  target_modules=adapter.target_modules, fingerprint=adapter.fingerprint)


def adapter_from_proto(msg: common_pb2.AdapterInfo) -> AdapterInfo:
    return AdapterInfo(msg.name, msg.path, msg.rank, msg.alpha, tuple(msg.target_modules), msg.fingerprint)
