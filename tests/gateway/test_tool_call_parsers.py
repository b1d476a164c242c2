"""The tool-call parsers on replies as models write them, fed whole and in pieces cut at every
boundary: the streamed deltas (each call named once, then its arguments in pieces) assemble to
exactly the whole reply, which is the one written out here by hand. Malformed calls are content."""

from __future__ import annotations

import time

import pytest

from services.gateway.tool_calls import PARSERS
from services.gateway.tool_calls.constrained import ConstrainedCallParser, ToolCallShape
from services.gateway.tool_calls.json_call import MAX_HEADER_CHARS
from services.gateway.tool_calls.reader import ReplyReader, WholeReply, read_whole

NAMES = frozenset({"get_weather", "get_time"})
WEATHER_PARIS = '{"city": "Paris", "unit": "celsius"}'
TIME_UTC = '{"zone": "UTC"}'
TRICKY = '{"city": "São {Paulo}] \\"x\\"", "unit": "celsius", "days": [1, {"a": []}]}'

CASES = [
    # (format, reply text, content, calls)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>' % WEATHER_PARIS,
     None, [("get_weather", WEATHER_PARIS)]),
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": %s}\n</tool_call>' % (WEATHER_PARIS, TIME_UTC),
     "Let me check.", [("get_weather", WEATHER_PARIS), ("get_time", TIME_UTC)]),
    ("hermes", '<tool_call>{"name":"get_weather","arguments":%s}</tool_call> Done, see above.' % TRICKY,
     " Done, see above.", [("get_weather", TRICKY)]),
    ("hermes", "No tools needed: 2 < 3 and <tool is a word.", "No tools needed: 2 < 3 and <tool is a word.", []),
    # keys in another order: judged whole at the close marker
    ("hermes", '<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>',
     None, [("get_time", '{"zone": "CET"}')]),
    # a whole header makes a call: arguments that then are not JSON stay as written (as OpenAI's)
    ("hermes", 'A <tool_call>{"name": "get_weather", "arguments": {city: Paris}}</tool_call>',
     "A", [("get_weather", "{city: Paris}")]),
    # malformed before that (not JSON, an unknown function, cut short): content, markers and all
    ("hermes", 'A <tool_call>{"name": get_weather}</tool_call> B', 'A <tool_call>{"name": get_weather}</tool_call> B',
     []),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "get_', '<tool_call>{"name": "get_', []),
    ("hermes", '<tool_call>not json at all', '<tool_call>not json at all', []),
    # cut short inside the arguments (max_tokens): the call keeps what was written
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', None,
     [("get_weather", '{"city": "Pa')]),
    ("llama3_json", '{"name": "get_weather", "parameters": %s}' % WEATHER_PARIS, None,
     [("get_weather", WEATHER_PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": %s}; {"name": "get_weather", "arguments": %s}'
     % (TIME_UTC, TRICKY), None, [("get_time", TIME_UTC), ("get_weather", TRICKY)]),
    ("llama3_json", '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
    ("llama3_json", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("llama3_json", '{"name": "get_time", "parameters": %s} and some words' % TIME_UTC, "and some words",
     [("get_time", TIME_UTC)]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": %s}, {"name": "get_time", "arguments": %s}]'
     % (TRICKY, TIME_UTC), None, [("get_weather", TRICKY), ("get_time", TIME_UTC)]),
    ("mistral", 'Checking. [TOOL_CALLS]get_time[ARGS]%s' % TIME_UTC, "Checking.", [("get_time", TIME_UTC)]),
    ("mistral", "[TOOL_CALLS] nothing here", "[TOOL_CALLS] nothing here", []),
    ("mistral", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]', '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
     []),
    ("mistral", "Plain [TOOL text [ARGS] too.", "Plain [TOOL text [ARGS] too.", []),
]


def streamed(fmt: str, pieces: list[str], max_calls: int | None = None) -> WholeReply:
    """What a client assembles from the deltas of ``pieces`` fed one by one."""
    reader = ReplyReader(PARSERS[fmt](NAMES, max_calls), "call_x")
    content: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for piece in [*pieces, None]:
        text, deltas = reader.finish() if piece is None else reader.feed(piece)
        content.append(text)
        for delta in deltas:
            index = delta["index"]
            if "id" in delta:
                assert index not in names, "a call is named once"
                assert delta["type"] == "function" and delta["id"] == f"call_x_{index}"
                assert delta["function"]["arguments"] == ""
                names[index] = delta["function"]["name"]
                arguments[index] = []
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                arguments[index].append(delta["function"]["arguments"])
    assert sorted(names) == list(range(len(names)))
    text = "".join(content)
    calls = [(names[i], "".join(arguments[i])) for i in range(len(names))]
    return WholeReply(text if text or not calls else None, calls)


def splits(text: str):
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    if len(text) <= 90:
        for first in range(1, len(text)):
            for second in range(first + 1, len(text)):
                yield [text[:first], text[first:second], text[second:]]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_and_streamed_replies_agree_at_every_boundary(fmt, text, content, calls):
    whole = read_whole(PARSERS[fmt](NAMES), text)
    assert whole == WholeReply(content, calls)
    for pieces in splits(text):
        assert streamed(fmt, pieces) == whole, pieces


ONE_CALL_CASES = [
    # (format, reply text, content, the one call): what follows the first whole call is dropped
    (CASES[1][0], CASES[1][1], "Let me check.", ("get_weather", WEATHER_PARIS)),
    (CASES[2][0], CASES[2][1], None, ("get_weather", TRICKY)),
    (CASES[4][0], CASES[4][1], None, ("get_time", '{"zone": "CET"}')),
    (CASES[12][0], CASES[12][1], None, ("get_time", TIME_UTC)),
    (CASES[15][0], CASES[15][1], None, ("get_time", TIME_UTC)),
    (CASES[16][0], CASES[16][1], None, ("get_weather", TRICKY)),
    (CASES[17][0], CASES[17][1], "Checking.", ("get_time", TIME_UTC)),
]


@pytest.mark.parametrize(("fmt", "text", "content", "call"), ONE_CALL_CASES)
def test_max_calls_one_reads_the_first_call_and_stops(fmt, text, content, call):
    parser = PARSERS[fmt](NAMES, 1)
    whole = read_whole(parser, text)
    assert whole == WholeReply(content, [call])
    assert parser.done
    for pieces in splits(text):
        assert streamed(fmt, pieces, max_calls=1) == whole, pieces


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_max_calls_one_is_done_at_the_arguments_closing_brace(fmt):
    opening = {"hermes": '<tool_call>{"name": "get_weather", "arguments": ',
               "llama3_json": '{"name": "get_weather", "parameters": ',
               "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": '}[fmt]
    reader = ReplyReader(PARSERS[fmt](NAMES, 1), "c")
    reader.feed(opening + '{"city": "Paris"')
    assert not reader.done
    assert reader.feed("}")[1] == [{"index": 0, "function": {"arguments": "}"}}]
    assert reader.done  # without waiting for the format's ending
    assert reader.feed('}\n</tool_call><tool_call>{"name": "get_time", "arguments": {}}') == ("", [])
    assert reader.finish() == ("", [])
    assert reader.whole() == WholeReply(None, [("get_weather", '{"city": "Paris"}')])
    unlimited = ReplyReader(PARSERS[fmt](NAMES), "c")
    unlimited.feed(opening + '{"city": "Paris"}')
    assert not unlimited.done


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_arguments_stream_before_the_call_is_complete(fmt):
    """The name goes out once its header is read, and arguments as they come, not at the end."""
    opening = {"hermes": '<tool_call>{"name": "get_weather", "arguments": ',
               "llama3_json": '{"name": "get_weather", "parameters": ',
               "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": '}[fmt]
    reader = ReplyReader(PARSERS[fmt](NAMES), "c")
    assert reader.feed(opening) == ("", [])  # not yet: "{" decides it is an object
    text, deltas = reader.feed('{"city": "Pa')
    assert text == ""
    assert deltas == [{"index": 0, "id": "c_0", "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}},
                      {"index": 0, "function": {"arguments": '{"city": "Pa'}}]
    assert reader.feed('ris"}')[1] == [{"index": 0, "function": {"arguments": 'ris"}'}}]


def test_content_flows_and_only_a_possible_marker_is_held():
    reader = ReplyReader(PARSERS["hermes"](NAMES), "c")
    assert reader.feed("It is sunny <tool") == ("It is sunny", [])  # " <tool" may begin a call
    assert reader.feed("s> rule.") == (" <tools> rule.", [])
    reader = ReplyReader(PARSERS["llama3_json"](NAMES), "c")
    assert reader.feed("Hello") == ("Hello", [])



HOSTILE_DELTAS = 8_000
HOSTILE_REPLIES = [
    # (format, what opens the reply, the delta repeated): held-back text a prompt can make a model write
    ("hermes", "<tool_call>", " "),  # whitespace where the header should be
    ("hermes", '<tool_call>{"name": "', "a"),  # a name that never ends
    ("hermes", '<tool_call>{"arguments": {}, "x": "', "a"),  # a block judged at its close marker, which never comes
    ("llama3_json", "", " "),
    ("llama3_json", '{"name": "', "a"),
    ("mistral", "[TOOL_CALLS]", " "),
    ("mistral", "[TOOL_CALLS]", "a"),  # a [TOOL_CALLS]name[ARGS] name that never ends
    ("mistral", '[TOOL_CALLS][{"name": "', "a"),
]


def _read_time(fmt: str, deltas: list[str]) -> float:
    reader = ReplyReader(PARSERS[fmt](NAMES), "c")
    started = time.perf_counter()
    for delta in deltas:
        reader.feed(delta)
    reader.finish()
    return time.perf_counter() - started


@pytest.mark.parametrize(("fmt", "opening", "delta"), HOSTILE_REPLIES)
def test_hostile_replies_cost_time_linear_in_their_length(fmt, opening, delta):
    """Each delta's work is bounded (headers capped, searches resumed): 8,000 deltas held back
    cost about what plain text does. Rescanning the held text per delta took 15-22 s."""
    plain = min(_read_time(fmt, ["word "] * HOSTILE_DELTAS) for _ in range(3))
    held = _read_time(fmt, [opening] + [delta] * HOSTILE_DELTAS)
    assert held < 20 * plain + 0.5, (held, plain)


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_a_header_longer_than_the_cap_is_not_streamed(fmt):
    """Past MAX_HEADER_CHARS a header is no call's: content, or for hermes a block judged whole
    at its close marker."""
    name = "f" * MAX_HEADER_CHARS
    text = {"hermes": '<tool_call>{"name": "%s", "arguments": {}}</tool_call>',
            "llama3_json": '{"name": "%s", "parameters": {}}',
            "mistral": '[TOOL_CALLS][{"name": "%s", "arguments": {}}]'}[fmt] % name
    reader = ReplyReader(PARSERS[fmt](None), "c")
    assert reader.feed(text[:-1]) == (("", []) if fmt == "hermes" else (text[:-1], []))
    reader.feed(text[-1:])
    reader.finish()
    assert reader.whole() == (WholeReply(None, [(name, "{}")]) if fmt == "hermes" else WholeReply(text, []))
    short = text.replace(name, "get_time")
    assert read_whole(PARSERS[fmt](None), short).calls == [("get_time", "{}")]


REQUIRED = ToolCallShape(None, ("get_weather", "get_time"))
WRAPPED = REQUIRED.prefix_of("get_weather") + WEATHER_PARIS + "}"


@pytest.mark.parametrize("shape, text, whole, calls", [
    # a named function: the reply is its arguments, whole or cut
    (ToolCallShape("get_time"), TIME_UTC, True, [("get_time", TIME_UTC)]),
    (ToolCallShape("get_time"), '{"zone": "U', False, [("get_time", '{"zone": "U')]),
    # required: the wrapper's closing brace is not an argument when the reply ended by itself...
    (REQUIRED, WRAPPED, True, [("get_weather", WEATHER_PARIS)]),
    # ...and a cut reply keeps all it wrote after the name, a last brace included
    (REQUIRED, WRAPPED[:-1], False, [("get_weather", WEATHER_PARIS)]),
    (REQUIRED, WRAPPED[:-3], False, [("get_weather", WEATHER_PARIS[:-2])]),
    # cut before the name: neither content nor calls
    (REQUIRED, '{"name": "get_wea', False, []),
])
def test_a_constrained_call_reads_the_same_whole_and_cut_at_every_boundary(shape, text, whole, calls):
    for cut in range(len(text) + 1):
        reader = ReplyReader(ConstrainedCallParser(shape), "call_r_3", numbered=False)
        deltas = []
        for piece in (text[:cut], text[cut:]):
            content, new = reader.feed(piece)
            assert content == ""
            deltas += new
        content, new = reader.finish(whole=whole)
        assert content == ""
        deltas += new
        assert reader.whole() == WholeReply(None, calls)
        opened = [d for d in deltas if "id" in d]
        assert [(d["id"], d["index"], d["function"]["name"]) for d in opened] == [
            ("call_r_3", 0, name) for name, _ in calls]
        assert "".join(d["function"]["arguments"] for d in deltas) == "".join(a for _, a in calls)
