"""The executor's sampler: one vectorized pass over the batch with per-row parameters.

Pipeline (see penalties.py and truncation.py for the math of each stage)::

    logits [B, V] (any float dtype) ──copy to float32──▶
      grammar mask → logit_bias → min_tokens ban → repetition penalty → frequency/presence penalties
      ──▶ greedy rows: argmax here
      ──▶ temperature → min-p → top-k → top-p → softmax → exponential race → token

Greedy rows go through temperature and truncation with the others (their temperature is 1
and every cut keeps the maximum), so their argmax is taken once at the end without
copying the penalized logits.

Logprobs are those of the model's raw distribution: ``log_softmax`` of the logits before
bias, penalties, temperature and truncation. That is what the model believes (the quantity
used for scoring, perplexity and speculative verification), it is the same whatever
sampling parameters a request uses, and it is vLLM's default (``raw_logprobs``). A token
that truncation removed can therefore appear among the top alternatives.

Random draw: the exponential race. With q_i ~ Exp(1) independent, ``argmax_i p_i / q_i``
is distributed as p (the Gumbel-max trick in another guise), so one elementwise division
and an argmax sample the whole batch with no cumsum / searchsorted. A seeded row's noise
comes from a generator seeded by (seed, position) only, so its tokens do not depend on
the other rows, their number or its own row index. Unseeded rows share one generator
and one vectorized draw per step.

Nothing here reads a device value on the host; the only synchronization is in
``SamplerOutput.to_lists``, which the caller invokes when it needs Python values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.runtime.sampling.batch import SamplingBatch
from services.runtime.sampling.penalties import apply_penalties
from services.runtime.sampling.token_mask import apply_token_bitmask_
from services.runtime.sampling.truncation import apply_temperature, apply_truncation
from services.common.step import TokenLogprobs

# Exp(1) noise of exactly 0 would make masked tokens 0 / 0 = NaN, which argmax ranks first.
_MIN_NOISE = torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class ProcessedLogits:
    """The distribution the draw sees, exposed so that tests can check it before the draw."""

    logits: torch.Tensor
    """[B, V] float32 after every stage that applies (penalties; then temperature and
    truncation when some row samples). Removed tokens hold -inf."""
    probs: torch.Tensor | None
    """[B, V] float32 softmax of ``logits``; None when every row is greedy. Greedy rows'
    entries are computed at temperature 1 and are not used."""


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor
    """[B] int64."""
    logprobs: torch.Tensor | None = None
    """[B] float32 raw logprob of each sampled token; None when no row asked for logprobs."""
    top_token_ids: torch.Tensor | None = None
    """[B, n] int64, most likely first, n = the largest ``logprobs`` in the batch; None when n = 0."""
    top_logprobs: torch.Tensor | None = None
    """[B, n] float32 raw logprobs of top_token_ids."""

    def to_lists(self, batch: SamplingBatch) -> list[tuple[int, TokenLogprobs | None]]:
        """Per row: (token id, logprobs sliced to the row's own n, or None if it asked none)."""
        token_ids = self.token_ids.tolist()
        if self.logprobs is None:
            return [(token_id, None) for token_id in token_ids]
        logprobs = self.logprobs.tolist()
        top_ids = self.top_token_ids.tolist() if self.top_token_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        rows: list[tuple[int, TokenLogprobs | None]] = []
        for row, token_id in enumerate(token_ids):
            n = batch.logprobs_per_row[row]
            if n is None:
                rows.append((token_id, None))
            elif n == 0 or top_ids is None or top_lps is None:
                rows.append((token_id, TokenLogprobs(logprob=logprobs[row])))
            else:
                rows.append((token_id, TokenLogprobs(logprobs[row], top_ids[row][:n], top_lps[row][:n])))
        return rows


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> ProcessedLogits:
    """Every stage before the draw, on a float32 copy (the caller's logits are not modified)."""
    work = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [B, V] contiguous
    work.copy_(logits)
    if batch.token_bitmask is not None:
        apply_token_bitmask_(work, batch.token_bitmask, batch.grammar_rows)
    apply_penalties(work, batch)
    if batch.flags.grammar and batch.flags.min_tokens_ban:
        _undo_ban_where_nothing_left(work, logits, batch)
    if not batch.flags.any_sampling:
        return ProcessedLogits(logits=work, probs=None)
    if batch.flags.temperature:
        apply_temperature(work, batch)
    apply_truncation(work, batch)
    return ProcessedLogits(logits=work, probs=work.softmax(dim=-1))


def _undo_ban_where_nothing_left(work: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch) -> None:
    """A grammar that is complete allows only EOS, which min_tokens may ban: the grammar wins
    (its language has ended), so such a row gets back its grammar-masked raw logits."""
    assert batch.token_bitmask is not None and batch.grammar_rows is not None
    rows = batch.grammar_rows
    dead = torch.isinf(work[rows]).all(dim=-1)  # [G]
    if bool(dead.any()):
        restored = logits[rows].to(torch.float32)
        apply_token_bitmask_(restored, batch.token_bitmask)
        work[rows] = torch.where(dead[:, None], restored, work[rows])


class Sampler:
    """Draws one token per row. Holds the generators; everything else comes with the batch.

    ``seed`` fixes the shared generator of unseeded rows (tests, reproducible benchmarks);
    None seeds it from the operating system's entropy.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        # One generator per device, re-seeded for each seeded row: same streams as a fresh
        # generator per row, without allocating one per row per step.
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def reset(self) -> None:
        """Start over as a new ``Sampler(seed)``: the next unseeded draws are a fresh one's."""
        self._shared_generators.clear()
        self._row_generators.clear()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        _check_logits(logits, batch)
        flags = batch.flags
        if flags.argmax_only:
            return SamplerOutput(token_ids=logits.argmax(dim=-1))

        processed = process_logits(logits, batch)
        if not flags.any_sampling:
            token_ids = processed.logits.argmax(dim=-1)  # [B]
        else:
            assert processed.probs is not None
            token_ids = self._draw(processed.probs, batch)  # [B]
            if flags.any_greedy:
                token_ids = torch.where(batch.is_greedy, processed.logits.argmax(dim=-1), token_ids)

        if flags.max_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [B, V]
        sampled_logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [B]
        if flags.max_logprobs == 0:
            return SamplerOutput(token_ids=token_ids, logprobs=sampled_logprobs)
        top_logprobs, top_token_ids = raw_logprobs.topk(flags.max_logprobs, dim=-1)  # [B, n] each
        return SamplerOutput(token_ids, sampled_logprobs, top_token_ids, top_logprobs)

    def _draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[B] argmax(p / q), q ~ Exp(1): distributed as ``probs`` row by row."""
        noise = torch.empty_like(probs)  # [B, V]
        if len(batch.seeded_rows) < batch.size:
            noise.exponential_(generator=self._generator(self._shared_generators, probs.device, self._seed))
        if batch.seeded_rows:
            generator = self._generator(self._row_generators, probs.device, 0)
            for row, row_seed in zip(batch.seeded_rows, batch.seeded_row_seeds):
                generator.manual_seed(row_seed)
                noise[row].exponential_(generator=generator)  # [V], contiguous view
        noise.clamp_min_(_MIN_NOISE)
        return probs.div(noise).argmax(dim=-1)

    @staticmethod
    def _generator(
        cache: dict[torch.device, torch.Generator], device: torch.device, seed: int | None
    ) -> torch.Generator:
        generator = cache.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
            cache[device] = generator
        return generator


def _check_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    if tuple(logits.shape) != (batch.size, batch.vocab_size):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match the batch "
            f"(size={batch.size}, vocab_size={batch.vocab_size})"
        )
