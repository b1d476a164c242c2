"""Stop strings over streamed text: find them across deltas, never show a partial one.

Semantics (independent of how the text is cut into deltas): generation stops at the first
point, reading the text character by character, where the text read so far ends with a stop
string. If two stop strings end at the same character, the longer one (starting earlier) wins.
The emitted text is everything before the stop string, plus the stop string itself when
include_stop_str_in_output is set.

Text that could be the beginning of a stop string is held back until the next delta decides:
with stop "ab", "xa" emits "x" and holds "a"; a following "c" releases "ac", a following "b"
stops. ``finish()`` releases what is held when generation ends for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text deltas; get back (text to emit, matched stop string or None).

    Cost per delta: O((held + delta) * number of stops) for the search, where held is shorter
    than the longest stop string.
    """

    __slots__ = ("_stops", "_include", "_prefixes", "_first_chars", "_max_hold", "_held", "_matched")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        """``stop``: stop strings already checked by ``StopConditions.validate`` (non-empty,
        within the limits); duplicates are dropped here."""
        self._stops = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        # Every proper prefix of every stop string: a suffix of the text in this set must wait.
        self._prefixes = frozenset(s[:n] for s in self._stops for n in range(1, len(s)))
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self._matched: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

    @property
    def matched(self) -> str | None:
        """The stop string that ended generation, once one was found."""
        return self._matched

    @property
    def held(self) -> str:
        """Text withheld because it may begin a stop string."""
        return self._held

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Process the next text delta; after a match the stream is over."""
        if self._matched is not None:
            raise RuntimeError(f"feed() after stop string {self._matched!r} matched: the stream is over")
        if not self._stops:
            return delta, None
        text = self._held + delta
        match = self._earliest_match(text)
        if match is not None:
            start, stop = match
            self._matched = stop
            self._held = ""
            end = start + len(stop) if self._include else start
            return text[:end], stop
        hold = self._longest_pending_suffix(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def finish(self) -> str:
        """Release held text (generation ended by length, EOS or abort); empty after a match."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the occurrence that ends first; ties go to the longer stop string."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return None
        end, negative_length, stop = best
        return end + negative_length, stop

    def _longest_pending_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for start in range(max(0, len(text) - self._max_hold), len(text)):
            if text[start] in self._first_chars and text[start:] in self._prefixes:
                return len(text) - start
        return 0
