"""The engine's token logprobs in OpenAI's two shapes: completions' parallel lists and chat's entries."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.pb.tokenmill.v1 import common_pb2
from services.gateway.http.tokens import TokenNamer


def completion_logprobs(entries: Sequence[common_pb2.TokenLogprob], namer: TokenNamer, offset: int) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offsets count from ``offset``."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in entries:
        name, _ = namer.name(entry.token_id)
        tokens.append(name)
        values.append(entry.logprob)
        tops.append({namer.name(t)[0]: lp for t, lp in zip(entry.top_token_ids, entry.top_logprobs)})
        offsets.append(offset)
        offset += len(name)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: Sequence[common_pb2.TokenLogprob], namer: TokenNamer) -> dict:
    """{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for entry in entries:
        name, raw = namer.name(entry.token_id)
        top = []
        for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs):
            top_name, top_raw = namer.name(token_id)
            top.append({"token": top_name, "logprob": logprob, "bytes": top_raw})
        content.append({"token": name, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}
