"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the last time the text
ended the way it ends now. Pure Python, no model.

For a sequence t[0..L) and n from max_ngram down to min_ngram, take the suffix n-gram
t[L-n..L) and find its most recent earlier occurrence t[e-n..e) with e <= L-1 (an occurrence
that is not the suffix itself; it may overlap it). The first n that matches wins, and the
proposal is t[e..e+k): the k tokens that followed, fewer when e+k passes the end.

Rescanning the sequence per step costs O(L) per sequence per step. `NgramIndex` keeps, for
each n, a dict from n-gram to the end of its most recent occurrence, updated as tokens are
appended; a lookup is then O(max_ngram). The index lags the sequence by one position on purpose:
the n-grams ending at L (the current suffixes) are only registered when the next token arrives,
so a lookup never finds the suffix itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.drafter.proposer import DraftMethod, Proposer, ProposerInfo, ProposerSession

MAX_NGRAM = 16
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True, slots=True)
class NgramProposer(Proposer):
    """Settings of prompt-lookup drafting and the lookup itself."""

    max_ngram: int = 4
    """Longest suffix n-gram tried first."""
    min_ngram: int = 1
    """Shortest suffix n-gram tried before giving up (no proposal)."""
    num_speculative_tokens: int = 4
    """k: how many following tokens a match proposes."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"min_ngram must be in [1, max_ngram={self.max_ngram}], got min_ngram={self.min_ngram}"
            )
        if self.max_ngram > MAX_NGRAM:
            raise ValueError(f"max_ngram must be <= {MAX_NGRAM} (MAX_NGRAM), got {self.max_ngram}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] (MAX_SPECULATIVE_TOKENS), "
                f"got {self.num_speculative_tokens}"
            )

    def new_session(self) -> DraftState:
        return DraftState(self)

    def info(self) -> ProposerInfo:
        return ProposerInfo(DraftMethod.NGRAM, self.num_speculative_tokens,
                            ngram_min=self.min_ngram, ngram_max=self.max_ngram)

    def new_index(self, token_ids: Iterable[int] = ()) -> NgramIndex:
        return NgramIndex(self.min_ngram, self.max_ngram, token_ids)

    def propose(self, index: NgramIndex, num_tokens: int | None = None) -> list[int]:
        """Up to k (or num_tokens, if smaller) draft tokens for the sequence in `index`."""
        if (index.min_ngram, index.max_ngram) != (self.min_ngram, self.max_ngram):
            raise ValueError(
                f"index covers n-grams [{index.min_ngram}, {index.max_ngram}], "
                f"the proposer [{self.min_ngram}, {self.max_ngram}]"
            )
        k = self.num_speculative_tokens if num_tokens is None else min(num_tokens, self.num_speculative_tokens)
        if k <= 0:
            return []
        tokens = index.tokens
        # An earlier occurrence ends at e <= L-1 and starts at e-n >= 0, so n <= L-1.
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = index.previous_end_of_suffix(n)
            if end is not None:
                return tokens[end : end + k]
        return []

    def propose_for(self, token_ids: Sequence[int]) -> list[int]:
        """One-off proposal for a token list (builds a throwaway index: O(L))."""
        return self.propose(self.new_index(token_ids))


class NgramIndex:
    """A sequence's tokens and, for each n, where each n-gram last ended (exclusive end index).

    Invariant: ``_last_end[n - min_ngram]`` holds every n-gram ending at e in [n, L-1], mapped to
    the largest such e, where L = len(tokens).
    """

    __slots__ = ("min_ngram", "max_ngram", "tokens", "_last_end")

    def __init__(self, min_ngram: int, max_ngram: int, token_ids: Iterable[int] = ()) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_ngram, max_ngram + 1)]
        self.extend(token_ids)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens: O(max_ngram) each."""
        tokens = self.tokens
        for token_id in token_ids:
            length = len(tokens)
            # The suffixes ending at `length` become "earlier" occurrences once this token lands.
            for table, n in zip(self._last_end, range(self.min_ngram, min(self.max_ngram, length) + 1)):
                table[tuple(tokens[length - n :])] = length
            tokens.append(token_id)

    def previous_end_of_suffix(self, n: int) -> int | None:
        """End of the most recent occurrence of the current suffix n-gram other than itself."""
        if not self.min_ngram <= n <= self.max_ngram or n > len(self.tokens):
            return None
        return self._last_end[n - self.min_ngram].get(tuple(self.tokens[-n:]))

    def __len__(self) -> int:
        return len(self.tokens)


class DraftState(ProposerSession):
    """Per-sequence n-gram indexes of the drafter, keyed by sequence id.

    The drafter service is the one owner: it opens a sequence with its known tokens (prompt, plus
    output after a preemption), appends the tokens each step accepted, asks for proposals, and
    closes the sequence when the scheduler reports it finished, aborted or preempted.
    """

    __slots__ = ("proposer", "_indexes")

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer
        self._indexes: dict[int, NgramIndex] = {}

    def open(self, seq_id: int, token_ids: Sequence[int]) -> None:
        if seq_id in self._indexes:
            raise ValueError(f"seq_id {seq_id} is already open")
        self._indexes[seq_id] = self.proposer.new_index(token_ids)

    def append(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self._get(seq_id).extend(token_ids)

    def propose(self, seq_id: int, num_tokens: int | None = None) -> list[int]:
        return self.proposer.propose(self._get(seq_id), num_tokens)

    def propose_batch(self, seq_ids: Sequence[int], num_tokens: int | None = None) -> list[list[int]]:
        return [self.propose(seq_id, num_tokens) for seq_id in seq_ids]

    def close(self, seq_id: int) -> None:
        """Forget a sequence; unknown ids are ignored (finish and abort may both report it)."""
        self._indexes.pop(seq_id, None)

    def close_all(self) -> None:
        self._indexes.clear()

    def num_tokens(self, seq_id: int) -> int:
        return len(self._get(seq_id))

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._indexes

    def __len__(self) -> int:
        return len(self._indexes)

    def _get(self, seq_id: int) -> NgramIndex:
        index = self._indexes.get(seq_id)
        if index is None:
            raise ValueError(f"seq_id {seq_id} is not open")
        return index
