"""The proposer interface: what the drafter's servicer asks of whatever makes drafts.

A ``Proposer`` holds settings and what every stream shares (a draft model's weights and KV
pool). Each Propose stream opens a ``ProposerSession`` of its own, which holds that stream's
sequences: the scheduler's sequence ids are only unique within one stream, and a stream that
ends forgets all of its sequences (``close_all``).

The servicer applies each message to a session in one order: close, open, append accepted
tokens, then ``propose`` for the listed sequences in one call, so a proposer that runs a model
can batch every sequence of the step into one forward per draft position.

Two implementations: prompt lookup (services/drafter/ngram.py) and a draft model
(services/drafter/draft_model.py).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class DraftMethod(enum.Enum):
    """How drafts are produced (the flag values of --method)."""

    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


@dataclass(frozen=True, slots=True)
class ProposerInfo:
    """What GetDrafterInfo reports; fields that do not apply to the method are 0 or empty."""

    method: DraftMethod
    num_speculative_tokens: int
    """Default and largest number of draft tokens per sequence per step."""
    draft_model_path: str = ""
    ngram_min: int = 0
    ngram_max: int = 0
    vocab_size: int = 0
    """The draft model's vocabulary size; the scheduler checks it against the target's."""


class ProposerSession(ABC):
    """The sequences of one Propose stream. Unknown ids raise ValueError naming the id."""

    __slots__ = ()

    @abstractmethod
    def open(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Start tracking a sequence with every known token (prompt and output so far)."""

    @abstractmethod
    def append(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Tokens the sequence gained (accepted drafts, the bonus or corrected token)."""

    @abstractmethod
    def close(self, seq_id: int) -> None:
        """Forget a sequence and free what it holds; unknown ids are ignored (finish and abort
        may both report one)."""

    @abstractmethod
    def close_all(self) -> None:
        """Forget every sequence (the stream ended)."""

    @abstractmethod
    def propose_batch(self, seq_ids: Sequence[int], num_tokens: int | None = None) -> list[list[int]]:
        """One draft per id, in order: at most ``num_tokens`` tokens (None = the configured k;
        never more than it), possibly none."""

    @abstractmethod
    def __contains__(self, seq_id: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


class Proposer(ABC):
    """A drafting method with its settings and shared resources."""

    __slots__ = ()

    runs_model: bool = False
    """True when proposing takes long enough (a model's forwards) that the servicer runs the
    session's work on a worker thread instead of the event loop."""

    @abstractmethod
    def new_session(self) -> ProposerSession:
        """Empty state for one Propose stream."""

    @abstractmethod
    def info(self) -> ProposerInfo: ...
