"""A Generate call's fields taken into the engine's values, at the servicer's edge.

Sizes are checked in place first (request_limits.py), then sampling, stop conditions and a
structured output are converted (its grammar compiled and prepared on the executors), then
the prompt is tokenized and checked against the context. Protobuf goes no further than here
and generation_codec.py: the servicer hands the engine an ``Intake``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.common.codec.step_codec import sampling_from_proto
from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.pb.tokenmill.v1 import generation_pb2
from services.common.sampling_params import SamplingParams
from services.common.step import ExecutorInfo
from services.scheduler.auth import Tenant
from services.scheduler.engine.core import EXECUTOR_UNAVAILABLE
from services.scheduler.generation_codec import stop_from_proto, structured_output_from_proto
from services.scheduler.request.stop import StopConditions
from services.scheduler.request_limits import RequestLimits, check_sizes
from services.scheduler.structured.grammar_compiler import GrammarCompiler
from services.scheduler.links.tokenizer_link import TokenizerPool
from services.scheduler.supervisor import Supervisor


@dataclass(slots=True)
class Intake:
    """What a Generate call keeps of its request once the fields are taken."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: StopConditions
    priority: int
    num_speculative_tokens: int | None


class GenerateIntake:
    def __init__(self, supervisor: Supervisor, grammar_compiler: GrammarCompiler, max_prompt_chars: int = 0,
                 model_name: str = "") -> None:
        self.supervisor = supervisor
        self.grammar_compiler = grammar_compiler
        self.max_prompt_chars = max_prompt_chars
        """0 = CHARS_PER_TOKEN_BOUND characters per token of the model's context (request_limits.py)."""
        self.model_name = model_name
        """What a tenant's permissions name the model by."""

    def executor_info(self) -> ExecutorInfo:
        """The model's facts, as the first attached executor reports them (every executor of
        an engine serves the same model)."""
        lane = next(iter(self.supervisor.core.lanes.values()), None)
        if lane is None:
            raise UnavailableError(EXECUTOR_UNAVAILABLE)
        return lane.info

    def _context_limit(self) -> int:
        return self.executor_info().max_model_len

    def limits(self) -> RequestLimits:
        return RequestLimits(self._context_limit(), self.max_prompt_chars, self.grammar_compiler.max_grammar_bytes)

    async def take(self, request: generation_pb2.GenerateRequest, tenant: Tenant | None,
                   share: str) -> Intake:
        """Every field the request's life needs, taken from the message: sizes checked in place
        first (request_limits.py), then copied, then the prompt tokenized."""
        check_sizes(request, self.limits())
        sampling = sampling_from_proto(request.sampling)
        stop = stop_from_proto(request.stop)
        structured = structured_output_from_proto(request)
        if tenant is not None:
            # Before any compile: a caller the tenant's permissions refuse costs no grammar work.
            tenant.check_request(self.model_name, request.priority)
        if structured is not None:
            # Before the prompt: a bad schema costs no tokenizer call, and the request
            # reaches the waiting queue only with its grammar ready.
            sampling.grammar = await self.grammar_compiler.compile(structured, share)
            # The executors build its matcher and first mask now, over the model's vocabulary,
            # off their step threads: no step pays for a new grammar.
            error = await self.supervisor.prepare_grammar(sampling.grammar)
            if error:
                raise InvalidArgumentError(f"{structured.field} cannot run on the model's vocabulary: {error}")
        spec_k = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None
        if spec_k is not None and spec_k < 0:
            raise InvalidArgumentError(f"num_speculative_tokens must be >= 0 (0 = no speculation), got {spec_k}")
        priority = request.priority
        prompt_ids = await _prompt_ids(request, self.supervisor.tokenizers, self._context_limit)
        return Intake(prompt_ids, sampling, stop, priority, spec_k)

    def most_tokens(self, intake: Intake) -> int:
        """What a request may use at most: its prompt and max_tokens (or the rest of the context)."""
        prompt = len(intake.prompt_ids)
        max_tokens = intake.stop.max_tokens
        return prompt + (max_tokens if max_tokens is not None else max(self._context_limit() - prompt, 0))


def _check_prompt_tokens(field: str, what: str, count: int, context_limit: Callable[[], int]) -> None:
    # The prompt must leave room for one generated token: refused here, by the field the
    # client set, before the ids are copied or queued.
    limit = context_limit()
    if count >= limit:
        raise InvalidArgumentError(f"prompt {field} {what} {count} tokens; the context limit is max_model_len="
                                   f"{limit} (prompt + at least one generated token)")


async def _prompt_ids(request: generation_pb2.GenerateRequest, tokenizers: TokenizerPool,
                      context_limit: Callable[[], int]) -> list[int]:
    """The prompt's token ids: encoded text, the ids sent, or the rendered chat; each refused
    by the field the client set when it leaves no room for a generated token."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgumentError("prompt is empty: set one of text, token_ids or chat")
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else None
    if add_special and kind != "text":
        raise InvalidArgumentError(f"add_special_tokens=true applies to text prompts only; a {kind} prompt is "
                                   "used as sent (token_ids) or as its chat template writes it (chat)")
    if kind == "text":
        if not request.text:
            raise InvalidArgumentError("prompt text is empty")
        ids = await tokenizers.encode(request.text, True if add_special is None else add_special)
        _check_prompt_tokens("text", "encodes to", len(ids), context_limit)
        return ids
    if kind == "token_ids":
        count = len(request.token_ids.ids)  # counted in place: the ids are copied only if they fit
        if not count:
            raise InvalidArgumentError("prompt token_ids is empty")
        _check_prompt_tokens("token_ids", "has", count, context_limit)
        return list(request.token_ids.ids)
    chat = request.chat
    if not chat.messages:
        raise InvalidArgumentError("prompt chat has no messages")
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    # The template writes its own BOS and turn markers; its ids come back as rendered.
    ids = await tokenizers.render_chat(chat.messages, add_prompt, chat.tools_json)
    _check_prompt_tokens("chat", "renders to", len(ids), context_limit)
    return ids
