"""GenerationServicer refuses at once while the executor is away: no tokenizer call, no queue place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.common.errors import InvalidArgumentError, UnavailableError
from services.scheduler.admission import Admission
from services.scheduler.request_entry import RequestEntry
from services.scheduler.servicer import GenerationServicer
from services.stack.client import build_request


class _Tokenizers:
    def __init__(self) -> None:
        self.calls = 0

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.calls += 1
        return [1, 2, 3]


def _servicer(connected: bool):
    tokenizers = _Tokenizers()
    port = SimpleNamespace(connected=connected)
    lanes = {"e0": SimpleNamespace(info=SimpleNamespace(max_model_len=512), role="mixed", port=port)} if connected \
        else {}
    supervisor = SimpleNamespace(core=SimpleNamespace(lanes=lanes, requests={}), tokenizers=tokenizers,
                                 submit=lambda *a, **k: pytest.fail("submitted while the executor is away"))
    entry = RequestEntry(supervisor.core)  # the real checks
    supervisor.unavailable_reason, supervisor.check_accepting = entry.unavailable_reason, entry.check_accepting
    admission = Admission(4)
    return GenerationServicer(supervisor, admission), tokenizers, admission


async def test_refused_before_tokenizing_while_the_executor_is_away():
    servicer, tokenizers, admission = _servicer(connected=False)
    stream = servicer.Generate(build_request("Once upon a time", max_tokens=4), context=None)
    with pytest.raises(UnavailableError, match=r"the executor is unavailable \(restarting or unreachable\); retry shortly"):
        await anext(stream)
    assert tokenizers.calls == 0
    assert admission.queued == 0


async def test_tokenized_and_submitted_while_the_executor_is_up():
    servicer, tokenizers, _ = _servicer(connected=True)
    submitted = []

    def submit(request_id, prompt_ids, *args, **kwargs):
        submitted.append(prompt_ids)
        raise UnavailableError("stop here")

    servicer.supervisor.submit = submit
    stream = servicer.Generate(build_request("Once upon a time", max_tokens=4), context=None)
    with pytest.raises(UnavailableError, match="stop here"):
        await anext(stream)
    assert tokenizers.calls == 1 and submitted == [[1, 2, 3]]


@pytest.mark.parametrize("prompt", [[5, 6, 7], None])
async def test_add_special_tokens_true_is_refused_for_token_ids_and_chat(prompt):
    servicer, tokenizers, admission = _servicer(connected=True)
    chat = [{"role": "user", "content": "hi"}] if prompt is None else None
    request = build_request(prompt, chat=chat, max_tokens=4)
    request.add_special_tokens = True
    kind = "chat" if prompt is None else "token_ids"
    with pytest.raises(InvalidArgumentError, match=f"add_special_tokens=true applies to text prompts only; a {kind} "):
        await anext(servicer.Generate(request, context=None))
    assert tokenizers.calls == 0 and admission.queued == 0


async def test_add_special_tokens_reaches_the_tokenizer_for_text():
    servicer, tokenizers, _ = _servicer(connected=True)
    seen = []

    async def encode(text, add_special_tokens):
        seen.append(add_special_tokens)
        return [1, 2, 3]

    tokenizers.encode = encode
    servicer.supervisor.submit = lambda *a, **k: (_ for _ in ()).throw(UnavailableError("stop here"))
    for flag in (False, True):
        request = build_request("Once upon a time", max_tokens=4)
        request.add_special_tokens = flag
        with pytest.raises(UnavailableError, match="stop here"):
            await anext(servicer.Generate(request, context=None))
    request = build_request("Once upon a time", max_tokens=4)  # absent = true
    with pytest.raises(UnavailableError, match="stop here"):
        await anext(servicer.Generate(request, context=None))
    assert seen == [False, True, True]
