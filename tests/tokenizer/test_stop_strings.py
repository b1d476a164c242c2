"""StopStringMatcher: stops across deltas, no partial stop ever emitted, chunking-independent."""

from __future__ import annotations

import random

import pytest

from services.common.detokenize import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, validate_stop_strings
from services.tokenizer.stop_strings import StopStringMatcher


def run(stops, deltas, include=False):
    """Feed deltas until a stop; returns (per-feed emitted texts + flush, matched stop)."""
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    out: list[str] = []
    for delta in deltas:
        text, matched = matcher.feed(delta)
        out.append(text)
        if matched is not None:
            return out, matched
    out.append(matcher.finish())
    return out, None


def reference(stops, text, include=False):
    """Read character by character; stop where the text read ends with a stop (longest wins)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def test_stop_spanning_deltas_is_found_and_never_shown_in_part():
    assert run(["</end>"], ["Hello </", "en", "d> more"]) == (["Hello ", "", ""], "</end>")


def test_overlapping_prefix_releases_the_first_char():
    # "aab" with stop "ab": the first "a" cannot start the match once a second "a" arrives.
    assert run(["ab"], ["a", "a", "b"]) == (["", "a", ""], "ab")
    assert run(["ab"], ["aab"]) == (["a"], "ab")


def test_held_text_is_released_when_the_prefix_breaks():
    assert run(["abc"], ["xa", "b", "d"]) == (["x", "", "abd", ""], None)


def test_held_text_is_flushed_on_finish():
    assert run(["stop"], ["it ends with st"]) == (["it ends with ", "st"], None)


def test_include_stop_str_in_output():
    assert run(["\n\n"], ["a\n", "\nb"], include=True) == (["a", "\n\n"], "\n\n")


def test_multiple_stops_first_to_end_wins():
    # "cd" ends (at index 4) before "abcde" would (at index 5), though "abcde" starts earlier.
    assert run(["abcde", "cd"], ["abcdef"]) == (["ab"], "cd")
    # Same end: the longer stop string wins.
    assert run(["cd", "bcd"], ["abcd"], include=False) == (["a"], "bcd")


def test_no_stops_passes_text_through():
    assert run([], ["a", "b"]) == (["a", "b", ""], None)


def test_feed_after_match_is_an_error():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == ("a", "x")
    assert matcher.matched == "x"
    with pytest.raises(RuntimeError, match="stream is over"):
        matcher.feed("more")


@pytest.mark.parametrize("include", [False, True])
def test_random_texts_and_chunkings_match_the_character_reference(include):
    rng = random.Random(include)
    for _ in range(400):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randrange(0, 30)))
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randrange(0, 8)))) if text else []
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out, matched = run(stops, deltas, include)
        expected_text, expected_stop = reference(stops, text, include)
        assert ("".join(out), matched) == (expected_text, expected_stop), (stops, deltas)
        # What was emitted before the last feed never contained a partial stop that later matched.
        assert all(expected_text.startswith("".join(out[: i + 1])) for i in range(len(out)))


def test_validation_names_the_field_and_the_limit():
    assert validate_stop_strings(["a", "b", "a"]) == ("a", "b")
    with pytest.raises(ValueError, match=f"stop has 17 strings; the limit MAX_STOP_STRINGS is {MAX_STOP_STRINGS}"):
        validate_stop_strings([str(i) for i in range(17)])
    with pytest.raises(ValueError, match=r"stop\[1\] is empty"):
        validate_stop_strings(["a", ""])
    with pytest.raises(ValueError, match=f"stop\\[0\\] has 257 characters; the limit MAX_STOP_STRING_CHARS is {MAX_STOP_STRING_CHARS}"):
        validate_stop_strings(["x" * 257])
    with pytest.raises(ValueError, match="single string"):
        validate_stop_strings("abc")
    assert validate_stop_strings(["x" * 256] * 16) == ("x" * 256,)


def test_long_stop_strings_hold_at_most_len_minus_one_chars():
    stop = "y" * MAX_STOP_STRING_CHARS
    matcher = StopStringMatcher([stop])
    assert matcher.feed("a" + "y" * 255) == ("a", None)
    assert matcher.held == "y" * 255
    assert matcher.feed("y") == ("", stop)
    other = StopStringMatcher([stop])
    assert other.feed("y" * 300 + "z") == ("", stop)
    again = StopStringMatcher([stop])
    assert again.feed("y" * 100 + "z" + "y" * 10) == ("y" * 100 + "z", None)
