"""The engine's token logprobs in OpenAI's two shapes (completions' parallel lists and chat's
entries), and prompt logprobs in OpenAI's echo shape and vLLM's ``prompt_logprobs``.

The engine's prompt logprobs hold every prompt token, the first with no logprob (nothing comes
before it): OpenAI's echo and vLLM both show null there."""

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


def echo_logprobs(entries: Sequence[common_pb2.TokenLogprob], namer: TokenNamer, top: int) -> dict:
    """The prompt's tokens in completions' shape (``echo`` with ``logprobs``): the first token's
    logprob and alternatives null; offsets count from 0."""
    out = completion_logprobs(entries, namer, 0)
    for key in ("top_logprobs", "token_logprobs"):
        if out[key]:
            out[key][0] = None
    out["top_logprobs"] = [t if t is None else dict(list(t.items())[:top]) for t in out["top_logprobs"]]
    return out


def joined(first: dict, second: dict) -> dict:
    """Two runs of completions' logprobs, the second's offsets already past the first's text."""
    return {key: first[key] + second[key] for key in first}


def end_offset(logprobs: dict) -> int:
    """Where text after these tokens starts."""
    if not logprobs["tokens"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def vllm_prompt_logprobs(entries: Sequence[common_pb2.TokenLogprob], namer: TokenNamer, top: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else {token id: {logprob,
    rank, decoded_token}} holding the prompt token and its ``top`` alternatives (rank: 1 for the
    most likely; null for a prompt token outside the alternatives the engine returned)."""
    out: list[dict | None] = [None] if entries else []
    for entry in entries[1:]:
        position: dict[str, dict] = {}
        for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids[:top], entry.top_logprobs[:top]), 1):
            position[str(token_id)] = {"logprob": logprob, "rank": rank, "decoded_token": namer.name(token_id)[0]}
        if str(entry.token_id) not in position:
            ids = list(entry.top_token_ids)
            rank = ids.index(entry.token_id) + 1 if entry.token_id in ids else None
            position[str(entry.token_id)] = {"logprob": entry.logprob, "rank": rank,
                                             "decoded_token": namer.name(entry.token_id)[0]}
        out.append(position)
    return out
