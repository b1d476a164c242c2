"""GenerationServicer refuses at once while the executor is away: no tokenizer call, no queue place."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from services.common.errors import UnavailableError
from services.scheduler.admission import Admission
from services.scheduler.loop import SchedulerLoop
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
    executor = SimpleNamespace(address="127.0.0.1:1", connected=connected, info=SimpleNamespace(max_model_len=512))
    loop = SimpleNamespace(core=object() if connected else None, executor=executor, tokenizers=tokenizers,
                           _stopping=False, submit=lambda *a, **k: pytest.fail("submitted while the executor is away"))
    loop.unavailable_reason = functools.partial(SchedulerLoop.unavailable_reason, loop)  # the real checks
    loop.check_accepting = functools.partial(SchedulerLoop.check_accepting, loop)
    admission = Admission(4)
    return GenerationServicer(loop, admission=admission), tokenizers, admission


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

    servicer.loop.submit = submit
    stream = servicer.Generate(build_request("Once upon a time", max_tokens=4), context=None)
    with pytest.raises(UnavailableError, match="stop here"):
        await anext(stream)
    assert tokenizers.calls == 1 and submitted == [[1, 2, 3]]
