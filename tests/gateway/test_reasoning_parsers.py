"""The reasoning parsers on replies as reasoning models write them, fed whole, cut at every one
and every two points, and one character at a time: every way of cutting gives the (reasoning,
content) written out here by hand. The content of a reply then goes through a tool-call reader,
so a call written while thinking is reasoning, never a call, and nothing of the reasoning reaches
the content or a call's arguments. The parser reads each character a bounded number of times."""

from __future__ import annotations

import itertools

import pytest

from services.gateway.reasoning import PARSERS, parser_name
from services.gateway.reasoning.think import ThinkParser
from services.gateway.tool_calls.hermes import HermesParser
from services.gateway.tool_calls.reader import ReplyReader

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

CASES = [
    # (format, reply text, reasoning, content)
    ("qwen3", "<think>\nThe user asks for a capital.\n</think>\n\nParis.", "The user asks for a capital.", "Paris."),
    ("qwen3", "  <think>a < b, and </thin is no tag</think>x</think>y", "a < b, and </thin is no tag", "x</think>y"),
    ("qwen3", "The capital is Paris.", "", "The capital is Paris."),
    ("qwen3", "\n <thinking> is not the tag", "", "\n <thinking> is not the tag"),
    ("qwen3", "<thin", "", "<thin"),  # cut short before the tag was whole: as written
    ("qwen3", "<think>cut short by max_tokens  \n", "cut short by max_tokens", ""),
    ("qwen3", "<think></think>", "", ""),
    ("qwen3", "<think>\n\n</think>\n\n", "", ""),
    ("qwen3", "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
    ("qwen3", "", "", ""),
    # the template wrote <think>: the reply starts inside the section
    ("deepseek_r1", "Okay, France.\n</think>\n\nThe capital of France is Paris.", "Okay, France.",
     "The capital of France is Paris."),
    ("deepseek_r1", "<think>\nwritten anyway</think>Paris", "written anyway", "Paris"),
    ("deepseek_r1", "never closed </thi", "never closed </thi", ""),
    ("deepseek_r1", "</think>Paris", "", "Paris"),
    ("deepseek_r1", "  ", "", ""),
    ("deepseek_r1", "one\n\ntwo  </think>  three\n", "one\n\ntwo", "three\n"),
]


def split(parser: ThinkParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


def cuts(text: str):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize(("fmt", "text", "reasoning", "content"), CASES)
def test_every_cut_gives_the_same_split(fmt, text, reasoning, content):
    for pieces in cuts(text):
        assert split(PARSERS[fmt](), pieces) == (reasoning, content), pieces


def test_content_sent_while_streaming_is_never_reasoning():
    """Pieces sent are never taken back: at every point of every cut, the content sent so far is
    a start of the whole reply's content, and the reasoning sent a start of its reasoning."""
    text = "<think>\nplan: answer </think> then stop\n</think>\nParis"
    for pieces in cuts(text):
        parser = PARSERS["qwen3"]()
        reasoning = content = ""
        for piece in pieces:
            r, c = parser.feed(piece)
            reasoning, content = reasoning + r, content + c
            assert "plan: answer".startswith(reasoning) and "then stop\n</think>\nParis".startswith(content)
        r, c = parser.finish()
        assert (reasoning + r, content + c) == ("plan: answer", "then stop\n</think>\nParis")


def read_with_calls(text: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    """Reasoning parser first, its content through a Hermes tool-call reader, as the gateway does."""
    think = PARSERS["deepseek_r1"]()
    reader = ReplyReader(HermesParser(frozenset({"get_weather"})), "call")
    reasoning = []
    for piece in pieces:
        r, c = think.feed(piece)
        reasoning.append(r)
        reader.feed(c)
    r, c = think.finish()
    reasoning.append(r)
    reader.feed(c)
    reader.finish()
    whole = reader.whole()
    return "".join(reasoning), whole.content, whole.calls


def test_a_call_written_while_thinking_is_reasoning_and_a_call_after_it_is_a_call():
    text = f"I could call: {CALL}\n</think>\n\nLet me check.\n{CALL}"
    for pieces in cuts(text):
        reasoning, content, calls = read_with_calls(text, pieces)
        assert reasoning == f"I could call: {CALL}"
        assert (content, calls) == ("Let me check.", [("get_weather", '{"city": "Paris"}')])
    # cut inside the thinking (max_tokens): all of it reasoning, no content, no call
    cut = text[:40]
    for pieces in cuts(cut):
        assert read_with_calls(cut, pieces) == (cut, "", [])


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_what_is_read_again_stays_bounded(fmt):
    """Linear in the reply: each delta is scanned with at most the 7 held characters of a tag's
    start, never the text read before (a long reply fed one character at a time)."""
    text = "  <think>" + "thinking < / </ </t \n " * 500 + "</think>" + "answer < / </think> " * 500
    parser = PARSERS[fmt]()
    for ch in text:
        parser.feed(ch)
        assert len(parser._tail) < len("</think>") and len(parser._opening) < len("<think>")
    assert parser.reasoning_closed


def test_settings_pick_the_route_then_the_gateway():
    assert parser_name("", "none") is None
    assert parser_name("", "qwen3") == "qwen3"
    assert parser_name("deepseek_r1", "qwen3") == "deepseek_r1"
    assert parser_name("none", "qwen3") is None
