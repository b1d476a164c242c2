"""Deltas that queue while a stream's previous write is in flight go out as one message."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.scheduler.request.delta import GenerationDelta, Timings, Usage
from services.scheduler.request.finish_reason import FinishReason
from services.common.step import TokenLogprobs
from services.scheduler.admission import Admission
from services.scheduler.generate_call import coalesce
from services.scheduler.servicer import GenerationServicer
from services.stack.client import build_request


def _lp(value: float) -> TokenLogprobs:
    return TokenLogprobs(value, [7], [value])


def _final(text: str = "", ids: tuple[int, ...] = ()) -> GenerationDelta:
    return GenerationDelta("r", text, list(ids), finish_reason=FinishReason.LENGTH, usage=Usage(3, 4, 0),
                           timings=Timings(1.0, 2.0, 3.0, 4.0))


def test_absorb_keeps_order_and_takes_the_later_ending():
    first = GenerationDelta("r", "Once", [10], [_lp(-0.1)])
    first.absorb(GenerationDelta("r", "", [11], [_lp(-0.2)]))  # text held back mid-character
    first.absorb(GenerationDelta("r", " upon", [12], [_lp(-0.3)]))
    assert (first.text, first.token_ids, [lp.logprob for lp in first.logprobs]) == ("Once upon", [10, 11, 12],
                                                                                    [-0.1, -0.2, -0.3])
    assert not first.finished
    first.absorb(_final(" a", (13,)))
    assert (first.text, first.token_ids, first.finish_reason) == ("Once upon a", [10, 11, 12, 13], "length")
    assert first.usage == Usage(3, 4, 0) and first.timings.e2e_ms == 4.0


def test_absorb_does_not_alias_the_absorbed_lists():
    later_lps = [_lp(-0.2)]
    first = GenerationDelta("r", "a", [1], [_lp(-0.1)])
    later = GenerationDelta("r", "b", [2], later_lps)
    first.absorb(later)
    first.token_ids.append(99)
    first.logprobs.append(_lp(-9.0))
    assert later.token_ids == [2] and later_lps == [_lp(-0.2)]


def test_a_finished_delta_absorbs_nothing():
    with pytest.raises(ValueError, match="finished delta cannot absorb"):
        _final().absorb(GenerationDelta("r", "x", [1]))


def test_coalesce_stops_at_the_final_delta_and_leaves_what_follows():
    queue: asyncio.Queue = asyncio.Queue()
    for item in (GenerationDelta("r", "b", [2]), _final("c", (3,)), GenerationDelta("r", "never", [4])):
        queue.put_nowait(item)
    delta = GenerationDelta("r", "a", [1])
    coalesce(delta, queue)
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("abc", [1, 2, 3], "length")
    assert queue.qsize() == 1


def _servicer_with(queued: list):
    deltas = asyncio.Queue()
    for item in queued:
        deltas.put_nowait(item)
    aborted = []
    core = SimpleNamespace(lanes={"e0": SimpleNamespace(info=SimpleNamespace(max_model_len=512))}, requests={})
    supervisor = SimpleNamespace(core=core, tokenizers=None, check_accepting=lambda: None,
                                 submit=lambda *a, **k: deltas, abort=aborted.append)
    return GenerationServicer(supervisor, Admission(4)), aborted


async def test_a_stream_that_fell_behind_gets_one_delta_then_finished():
    servicer, aborted = _servicer_with([GenerationDelta("r", "a", [1]), GenerationDelta("r", "b", [2]),
                                        _final("c", (3,))])
    messages = [m async for m in servicer.Generate(build_request([5, 6, 7], max_tokens=3), context=None)]
    assert [m.WhichOneof("event") for m in messages] == ["started", "delta", "finished"]
    assert (messages[1].delta.text, list(messages[1].delta.token_ids)) == ("abc", [1, 2, 3])
    assert messages[2].finished.usage.completion_tokens == 4 and not aborted
