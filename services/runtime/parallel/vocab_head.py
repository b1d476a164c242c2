"""A vocab-parallel LM head: each rank multiplies the rows rank 0 samples from by its share of
the vocabulary, and rank 0 gathers the shares into whole logits.

The final hidden states are the same on every rank (the last all-reduce hands each the same
sum; the shared-memory one bit for bit), so each rank can take its slice of the head
(shard.py, ``ShardPlan.vocab``) instead of rank 0 reading all of it: at batch 1 on the 100M
model the head is a fifth of the weights a step reads. Rank 0 names the rows in the step
header (``logit_rows``); after the forward every rank computes [R, its rows of V], padded to the
largest share, and rank 0 gathers [world, R, share] and lays the shares side by side
(docs/benchmarks.md, "Tensor parallelism on a CPU", measures it against the replicated head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.runtime.parallel.collectives import RankGroups

LM_HEADS = ("vocab", "replicated")
"""vocab: each rank's share of the vocabulary, gathered onto rank 0; replicated: rank 0 alone
holds and runs the whole head."""


class VocabParallelHead:
    def __init__(self, groups: RankGroups, local: Callable[[torch.Tensor], torch.Tensor], vocab: list[range]) -> None:
        """``local``: hidden [N, D] -> fp32 [N, len(vocab[rank])], this rank's rows of the head;
        ``vocab``: every rank's rows, by rank."""
        self.groups, self.local, self.vocab = groups, local, vocab
        self.width = max(len(r) for r in vocab)

    def _share(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.local(hidden)
        if logits.shape[1] < self.width:  # the shorter shares: padded, so every rank sends one shape
            logits = torch.nn.functional.pad(logits, (0, self.width - logits.shape[1]))
        return logits

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rank 0: hidden [N, D] -> fp32 logits [N, V]."""
        parts = self.groups.gather_to_first(self._share(hidden))  # [world, N, width]
        return torch.cat([parts[r, :, :len(rows)] for r, rows in enumerate(self.vocab)], dim=1)

    def contribute(self, hidden: torch.Tensor) -> None:
        """The other ranks: this rank's share of the logits of ``hidden`` to rank 0."""
        self.groups.gather_to_first(self._share(hidden))
