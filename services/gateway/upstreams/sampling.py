"""The request fields an HTTP upstream may be sent, read once from a GenerateRequest.

Each dialect (openai.py, anthropic.py) names which of these its API takes and under what key; a
field set on the request that its dialect does not name is refused naming it, never dropped, so
the two dialects cannot drift apart on what they carry or refuse. Values are ready for JSON:
OpenAI's signed seed, logit_bias keyed by strings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from services.common.pb.tokenmill.v1 import generation_pb2
from services.gateway.upstreams.errors import refused

Request = generation_pb2.GenerateRequest


def _set(part: str, field: str) -> Callable[[Request], Any]:
    """A field with presence: its value when set (0 included), else None."""
    return lambda r: getattr(getattr(r, part), field) if getattr(r, part).HasField(field) else None


def _nonzero(part: str, field: str) -> Callable[[Request], Any]:
    """A scalar without presence: its value unless it is the default (0, false)."""
    return lambda r: getattr(getattr(r, part), field) or None


def _seed(r: Request) -> int | None:
    """The engine's unsigned 64-bit seed back to OpenAI's signed one (the front end wrapped it)."""
    if not r.sampling.HasField("seed"):
        return None
    seed = r.sampling.seed
    return seed - (1 << 64) if seed >= 1 << 63 else seed


FIELDS: tuple[tuple[str, Callable[[Request], Any]], ...] = (
    ("temperature", _set("sampling", "temperature")),
    ("top_p", _set("sampling", "top_p")),
    ("top_k", _nonzero("sampling", "top_k")),
    ("min_p", _nonzero("sampling", "min_p")),
    ("repetition_penalty", _set("sampling", "repetition_penalty")),
    ("presence_penalty", _nonzero("sampling", "presence_penalty")),
    ("frequency_penalty", _nonzero("sampling", "frequency_penalty")),
    ("logit_bias", lambda r: {str(k): v for k, v in r.sampling.logit_bias.items()} or None),
    ("seed", _seed),
    ("logprobs", _set("sampling", "logprobs")),
    ("prompt_logprobs", _set("sampling", "prompt_logprobs")),
    ("max_tokens", _set("stop", "max_tokens")),
    ("stop", lambda r: list(r.stop.stop) or None),
    ("stop_token_ids", lambda r: list(r.stop.stop_token_ids) or None),
    ("ignore_eos", _nonzero("stop", "ignore_eos")),
    ("min_tokens", _nonzero("stop", "min_tokens")),
    ("include_stop_str_in_output", _nonzero("stop", "include_stop_str_in_output")),
)
"""Every sampling and stopping field of a GenerateRequest, by the name a refusal gives it."""


def sampling_body(kind: str, message: Request, names: Mapping[str, str]) -> dict[str, Any]:
    """The request's set fields under the keys ``names`` gives them; one it lacks is refused."""
    body: dict[str, Any] = {}
    for field, read in FIELDS:
        value = read(message)
        if value is None:
            continue
        key = names.get(field)
        if key is None:
            raise refused(kind, field)
        body[key] = value
    return body
