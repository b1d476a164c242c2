"""What a drafter holds of each sequence, so each ask sends only what changed.

The drafter keeps a copy of every sequence it drafts for. A step's ask carries sequences it
has not seen in full, known ones only with the tokens they gained since, and closes those
that left the batch. Both drafter ports (the gRPC link and the in-process one) build their
message from the ``ProposeBatch`` this makes, so the copy stays exact whether or not an
answer was used.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.request.request import Request


@dataclass(slots=True)
class ProposeBatch:
    closed: list[int]
    """Sequences the drafter must forget."""
    new: list[tuple[int, list[int]]]
    """(seq id, every known token) of sequences it has not seen."""
    appended: list[tuple[int, list[int]]]
    """(seq id, tokens gained since the last ask) of sequences it holds."""
    propose: list[int]
    """The sequences to draft for, in ask order."""
    num_tokens: int
    """The most drafts any of them wants."""


class DraftMirror:
    def __init__(self) -> None:
        self._known: dict[int, int] = {}
        """seq_id -> how many of its tokens the drafter holds, on the current session."""
        self._closing: list[int] = []
        """Known sequences to close in the next batch (the engine's sequences were all dropped)."""

    def batch(self, asks: list[tuple[Request, int]], live_seq_ids: Iterable[int]) -> ProposeBatch:
        """The next ask for ``asks`` ((request, most drafts wanted)); the drafter's copy is
        taken to match it from now on."""
        live = set(live_seq_ids)
        closed = self._closing + [seq_id for seq_id in self._known if seq_id not in live]
        self._closing = []
        for seq_id in closed:
            self._known.pop(seq_id, None)
        new: list[tuple[int, list[int]]] = []
        appended: list[tuple[int, list[int]]] = []
        for request, _ in asks:
            tokens = request.all_token_ids
            held = self._known.get(request.seq_id)
            if held is None:
                new.append((request.seq_id, list(tokens)))
            elif held < len(tokens):
                appended.append((request.seq_id, tokens[held:]))
            self._known[request.seq_id] = len(tokens)
        return ProposeBatch(closed, new, appended, [request.seq_id for request, _ in asks],
                            max(k for _, k in asks))

    def forget_all(self) -> None:
        """Every sequence was dropped (seq ids start over): close them all in the next batch."""
        self._closing.extend(self._known)
        self._known.clear()

    def reset(self) -> None:
        """A new drafter session holds nothing."""
        self._known.clear()
        self._closing.clear()
