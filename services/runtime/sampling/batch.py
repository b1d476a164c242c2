"""One step's sampling parameters as device tensors, built once per step from per-row data.

The sampler never looks at ``SamplingParams`` objects: it reads the packed tensors below and
the stage flags that say which transforms any row needs, so a batch that needs nothing but
an argmax pays for nothing else.

Host-to-device traffic is two copies per step: every per-row scalar goes up in one float
tensor ``[NUM_SCALARS, B]`` (plus the logit-bias values), every token index in one int64
tensor, and the fields below are views into those. Token indices are flat offsets into the
``[B, V]`` logits (``row * V + token``), so each sparse stage is a single ``index_put_``.

Cost: loops over rows only; the token histories are concatenated by NumPy. The histories
are re-sent every step (the interface takes lists); a caller that keeps them on the device
can skip that later without changing the sampler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from services.common.sampling_params import SamplingParams
from services.common.step import MinTokensBan

# Temperatures below this are treated as greedy: dividing logits by a denormal temperature
# overflows to inf and the softmax turns into NaN. Same threshold as vLLM's _SAMPLING_EPS.
MIN_SAMPLING_TEMPERATURE = 1e-5

_MASK_63 = (1 << 63) - 1
_MASK_64 = (1 << 64) - 1
# 2^64 / golden ratio (odd): consecutive user seeds land far apart before the position is added.
_SEED_MULTIPLIER = 0x9E3779B97F4A7C15


def derive_row_seed(seed: int, position: int) -> int:
    """The generator seed for one seeded draw: a function of (seed, position) only.

    ``seed * odd + position`` makes (seed, position) pairs distinct for any realistic
    position; the splitmix64 finalizer then spreads neighbouring values over all bits so
    that generators whose seeding is weak for close seeds still give unrelated streams.
    Masked to 63 bits because ``torch.Generator.manual_seed`` takes a non-negative int64.
    """
    x = (seed * _SEED_MULTIPLIER + position) & _MASK_64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK_64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK_64
    x ^= x >> 31
    return x & _MASK_63


def is_plain_greedy(params: SamplingParams, num_output_tokens: int, ban: MinTokensBan | None) -> bool:
    """Whether a row's token is the bare argmax of its raw logits: greedy, no logit bias, no
    penalty, no min-tokens ban in force at ``num_output_tokens``, no logprobs.

    The per-row form of ``StageFlags.argmax_only`` (a batch is argmax-only exactly when every
    row is plain greedy), cheap enough to check before building a batch: a caller whose rows all
    pass can take the argmax of the logits and skip ``SamplingBatch.build``.
    """
    return (
        params.temperature < MIN_SAMPLING_TEMPERATURE
        and not params.logit_bias
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.logprobs is None
        and (ban is None or not ban.token_ids or num_output_tokens >= ban.min_tokens)
    )


@dataclass(frozen=True, slots=True)
class StageFlags:
    """Which stages at least one row needs; a stage no row needs is skipped entirely."""

    any_sampling: bool
    """Some row is not greedy, so temperature, truncation and the random draw run."""
    any_greedy: bool
    logit_bias: bool
    min_tokens_ban: bool
    repetition_penalty: bool
    frequency_presence: bool
    temperature: bool
    """Some sampling row has a temperature other than 1."""
    min_p: bool
    top_k: bool
    top_p: bool
    max_logprobs: int | None
    """Largest ``logprobs`` over the rows that asked; None when no row did."""
    grammar: bool = False
    """Some row is constrained by a grammar mask."""

    @property
    def any_penalty(self) -> bool:
        return (self.logit_bias or self.min_tokens_ban or self.repetition_penalty or self.frequency_presence
                or self.grammar)

    @property
    def argmax_only(self) -> bool:
        """All rows greedy with nothing to apply first and no logprobs: a bare argmax."""
        return not (self.any_sampling or self.any_penalty or self.max_logprobs is not None)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling state for one step. Build it with :meth:`build`."""

    size: int
    vocab_size: int
    device: torch.device
    flags: StageFlags

    # Per-row scalars, each [B] float32 on the device (views into one uploaded tensor).
    temperature: torch.Tensor
    """Greedy rows hold 1.0 so the division is harmless; ``is_greedy`` picks their argmax."""
    top_k: torch.Tensor
    """[B] int64; 0 disables."""
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    is_greedy: torch.Tensor
    """[B] bool."""

    # Sparse stages as flat indices into the [B, V] logits (None when no row needs the stage).
    bias_index: torch.Tensor | None
    """[N_bias] int64 flat indices; each (row, token) at most once since biases are dicts."""
    bias_value: torch.Tensor | None
    """[N_bias] float32 added at bias_index."""
    ban_index: torch.Tensor | None
    """[N_ban] int64: stop tokens of rows that have generated fewer than min_tokens."""
    seen_index: torch.Tensor | None
    """[N_seen] int64: prompt + output tokens of rows with a repetition penalty (repeats allowed)."""
    output_index: torch.Tensor | None
    """[N_out] int64: output tokens of rows with a frequency/presence penalty, once per occurrence."""
    grammar_rows: torch.Tensor | None
    """[G] int64 rows constrained by a grammar; None when no row is."""
    token_bitmask: torch.Tensor | None
    """[G, W] int32 allowed-token bitmasks of grammar_rows (services/runtime/sampling/grammar.py)."""
    top_p_rows: torch.Tensor | None
    """[R] int64 rows that need top-p (a full-vocabulary sort), so only those are sorted;
    None when every row needs it or none does (``flags.top_p`` tells which)."""

    # Host-side per-row values the sampler needs as Python ints (generator seeding, slicing).
    positions: tuple[int, ...]
    """len(output_token_ids[row]): the index of the token drawn this step."""
    seeded_rows: tuple[int, ...]
    """Rows with a seed that sample (greedy rows draw nothing)."""
    seeded_row_seeds: tuple[int, ...]
    """derive_row_seed(seed, position) for each of seeded_rows."""
    logprobs_per_row: tuple[int | None, ...]
    top_k_max: int
    """Largest enabled top_k (clamped to V); 0 when no row uses top_k."""

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[Sequence[int]],
        output_token_ids: list[Sequence[int]],
        vocab_size: int,
        device: torch.device,
        min_tokens_bans: Sequence[MinTokensBan | None] | None = None,
        grammar_masks: tuple[Sequence[int], np.ndarray] | None = None,
    ) -> SamplingBatch:
        """Pack one step's rows. ``params`` must already be validated (``SamplingParams.validate``).

        ``min_tokens_bans``: per row, the ids it may not draw yet (``NewSequence.min_tokens_ban``);
        None = no row bans anything. ``grammar_masks``: (rows, [len(rows), W] int32 bitmasks) of
        the rows a grammar constrains; None = none is.
        """
        bans = _checked_bans(params, prompt_token_ids, output_token_ids, vocab_size, min_tokens_bans)
        size = len(params)
        device = torch.device(device)
        positions = tuple(len(out) for out in output_token_ids)
        greedy = [p.temperature < MIN_SAMPLING_TEMPERATURE for p in params]
        rows = _StageRows.of(params, bans, positions, greedy)
        index_parts = rows.flat_indices(params, bans, prompt_token_ids, output_token_ids, positions, vocab_size)
        scalars = _scalar_fields(params, greedy, rows, vocab_size, device)
        indices = dict(zip(("bias_index", "ban_index", "seen_index", "output_index", "top_p_rows"),
                           _split(_upload(np.concatenate(index_parts), device), [len(part) for part in index_parts])))
        top_k_max = min(max((params[row].top_k for row in rows.sampling), default=0), vocab_size)
        seeded_rows = tuple(row for row in rows.sampling if params[row].seed is not None)
        grammar_rows = token_bitmask = None
        if grammar_masks is not None and len(grammar_masks[0]):
            grammar_rows = _upload(np.asarray(grammar_masks[0], dtype=np.int64), device)
            token_bitmask = _upload(grammar_masks[1], device)
        flags = rows.flags(params, top_k_max)
        if grammar_rows is not None:
            flags = dataclasses.replace(flags, grammar=True)
        return cls(
            size=size,
            vocab_size=vocab_size,
            device=device,
            flags=flags,
            **scalars,
            **indices,
            grammar_rows=grammar_rows,
            token_bitmask=token_bitmask,
            positions=positions,
            seeded_rows=seeded_rows,
            seeded_row_seeds=tuple(derive_row_seed(params[row].seed, positions[row]) for row in seeded_rows),
            logprobs_per_row=tuple(p.logprobs for p in params),
            top_k_max=top_k_max,
        )


def _scalar_fields(params: list[SamplingParams], greedy: list[bool], rows: _StageRows, vocab_size: int,
                   device: torch.device) -> dict[str, torch.Tensor | None]:
    """The per-row scalars and the logit biases' values, uploaded as one tensor; the batch's
    fields as views into it."""
    size = len(params)
    bias_values = np.fromiter(
        chain.from_iterable(params[row].logit_bias.values() for row in rows.bias), dtype=np.float32
    )
    scalars_dev = _upload(np.concatenate([_scalars(params, greedy, vocab_size).reshape(-1), bias_values]), device)
    (temperature, top_k, top_p, min_p, repetition, presence, frequency, is_greedy) = (
        scalars_dev[: 8 * size].view(8, size).unbind(0)
    )
    return {"temperature": temperature, "top_k": top_k.to(torch.int64), "top_p": top_p, "min_p": min_p,
            "repetition_penalty": repetition, "presence_penalty": presence, "frequency_penalty": frequency,
            "is_greedy": is_greedy > 0.5, "bias_value": scalars_dev[8 * size:] if rows.bias else None}


def _checked_bans(
    params: list[SamplingParams],
    prompt_token_ids: list[Sequence[int]],
    output_token_ids: list[Sequence[int]],
    vocab_size: int,
    min_tokens_bans: Sequence[MinTokensBan | None] | None,
) -> Sequence[MinTokensBan | None]:
    """The per-row bans (None for every row when none are given), after checking the row counts."""
    size = len(params)
    if size == 0:
        raise ValueError("params is empty: a sampling batch needs at least one row")
    if len(prompt_token_ids) != size or len(output_token_ids) != size:
        raise ValueError(
            f"prompt_token_ids ({len(prompt_token_ids)} rows) and output_token_ids "
            f"({len(output_token_ids)} rows) must have one row per params entry ({size})"
        )
    bans = min_tokens_bans if min_tokens_bans is not None else [None] * size
    if len(bans) != size:
        raise ValueError(f"min_tokens_bans has {len(bans)} rows; expected one per params entry ({size})")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    return bans


def _scalars(params: list[SamplingParams], greedy: list[bool], vocab_size: int) -> np.ndarray:
    """[8, B] float32: the per-row scalars in SamplingBatch.build's unpack order."""
    return np.array(
        [
            [1.0 if greedy[row] else p.temperature for row, p in enumerate(params)],
            [min(p.top_k, vocab_size) for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            [p.repetition_penalty for p in params],
            [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params],
            greedy,
        ],
        dtype=np.float32,
    )  # top_k (clamped to V) is exact in float32 for any vocab below 2^24


@dataclass(slots=True)
class _StageRows:
    """The rows each stage applies to."""

    size: int
    sampling: list[int]
    bias: list[int]
    ban: list[int]
    repetition: list[int]
    count: list[int]
    """Rows with a presence or frequency penalty."""
    top_p: list[int]

    @classmethod
    def of(cls, params: list[SamplingParams], bans: Sequence[MinTokensBan | None], positions: tuple[int, ...],
           greedy: list[bool]) -> _StageRows:
        sampling = [row for row in range(len(params)) if not greedy[row]]
        return cls(
            size=len(params),
            sampling=sampling,
            bias=[row for row, p in enumerate(params) if p.logit_bias],
            ban=[row for row, ban in enumerate(bans)
                 if ban is not None and ban.token_ids and positions[row] < ban.min_tokens],
            repetition=[row for row, p in enumerate(params) if p.repetition_penalty != 1.0],
            count=[row for row, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0],
            top_p=[row for row in sampling if params[row].top_p < 1.0],
        )

    def flat_indices(self, params: list[SamplingParams], bans: Sequence[MinTokensBan | None],
                     prompt_token_ids: list[Sequence[int]], output_token_ids: list[Sequence[int]],
                     positions: tuple[int, ...], vocab_size: int) -> list[np.ndarray]:
        """The index upload's parts: logit bias, ban, seen tokens, output tokens, top-p rows."""
        return [
            _flat_indices(self.bias, [list(params[row].logit_bias) for row in self.bias], vocab_size, "logit_bias"),
            _flat_indices(self.ban, [bans[row].token_ids for row in self.ban], vocab_size, "min_tokens_ban"),
            _flat_indices(
                self.repetition,
                [chain(prompt_token_ids[row], output_token_ids[row]) for row in self.repetition],
                vocab_size,
                "prompt_token_ids/output_token_ids",
                lengths=[len(prompt_token_ids[row]) + positions[row] for row in self.repetition],
            ),
            _flat_indices(self.count, [output_token_ids[row] for row in self.count], vocab_size, "output_token_ids"),
            np.asarray(self.top_p if len(self.top_p) < self.size else [], dtype=np.int64),
        ]

    def flags(self, params: list[SamplingParams], top_k_max: int) -> StageFlags:
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return StageFlags(
            any_sampling=bool(self.sampling),
            any_greedy=len(self.sampling) < self.size,
            logit_bias=bool(self.bias),
            min_tokens_ban=bool(self.ban),
            repetition_penalty=bool(self.repetition),
            frequency_presence=bool(self.count),
            temperature=any(params[row].temperature != 1.0 for row in self.sampling),
            min_p=any(params[row].min_p > 0.0 for row in self.sampling),
            top_k=top_k_max > 0,
            top_p=bool(self.top_p),
            max_logprobs=max(requested) if requested else None,
        )


def _flat_indices(
    rows: list[int],
    token_ids_per_row: Sequence,
    vocab_size: int,
    field_name: str,
    lengths: list[int] | None = None,
) -> np.ndarray:
    """[sum of lengths] int64 ``row * V + token`` for each row's tokens, checked against [0, V).

    ``lengths`` is required when the per-row token ids are iterators rather than sequences.
    """
    if not rows:
        return np.empty(0, dtype=np.int64)
    if lengths is None:
        lengths = [len(ids) for ids in token_ids_per_row]
    total = sum(lengths)
    token_ids = np.fromiter(chain.from_iterable(token_ids_per_row), dtype=np.int64, count=total)
    if total and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        bad = int(token_ids[(token_ids < 0) | (token_ids >= vocab_size)][0])
        raise ValueError(f"{field_name} holds token id {bad}, outside [0, {vocab_size})")
    row_of_token = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    return row_of_token * vocab_size + token_ids


def _upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host-to-device copy; pinned and asynchronous when the target is a GPU."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _split(packed: torch.Tensor, lengths: list[int]) -> list[torch.Tensor | None]:
    """Views into ``packed`` of the given lengths, None for an empty part."""
    parts: list[torch.Tensor | None] = []
    start = 0
    for length in lengths:
        parts.append(packed[start : start + length] if length else None)
        start += length
    return parts
