"""The usage of a call whose upstream reported none (llama-cpp-python's server streams no usage).

The reply counts one token per streamed piece (servers that stream no usage stream one token per
event: exact there, where re-encoding the text need not give the tokens the model chose). The
prompt's text (a conversation's turns and tools, joined; the upstream's chat template is not known
here, so its few template tokens are missing) is counted with the target's ``tokenizer``, or
without one estimated at one token per CHARS_PER_TOKEN characters (OpenAI's rule of thumb for
English). Either way the Usage is marked ``estimated``: a client and the per-key token budgets see
a count, never a silent 0.
"""

from __future__ import annotations

import math
from pathlib import Path

from tokenizers import Tokenizer

from services.common.pb.tokenmill.v1 import generation_pb2

CHARS_PER_TOKEN = 4


def prompt_text(message: generation_pb2.GenerateRequest) -> str:
    prompt = message.WhichOneof("prompt")
    if prompt == "text":
        return message.text
    if prompt != "chat":
        return ""
    parts = [message.chat.tools_json] if message.chat.tools_json else []
    for turn in message.chat.messages:
        parts.append(turn.content)
        parts.extend(call.name + call.arguments for call in turn.tool_calls)
    return "\n".join(parts)


class UsageCounter:
    def __init__(self, tokenizer_path: str = "") -> None:
        self._tokenizer: Tokenizer | None = None
        if tokenizer_path:
            path = Path(tokenizer_path)
            try:
                self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
            except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception
                raise ValueError(f"tokenizer {tokenizer_path}: cannot load it: {exc}") from None

    def prompt_tokens(self, message: generation_pb2.GenerateRequest) -> int:
        if message.WhichOneof("prompt") == "token_ids":
            return len(message.token_ids.ids)
        text = prompt_text(message)
        if self._tokenizer is not None:
            return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
        return math.ceil(len(text) / CHARS_PER_TOKEN)
