"""Grammar bitmasks on logits (services/runtime/sampling/token_mask.py) against a per-token loop,
over vocabularies that end mid-word, and the sampler stage that applies them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.runtime.sampling.batch import SamplingBatch
from services.runtime.sampling.grammar import bitmask_words
from services.runtime.sampling.sampler import Sampler
from services.runtime.sampling.token_mask import (apply_token_bitmask_, token_allowed, unpack_token_bitmask,
                                                  unpack_token_bitmask_host)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def reference_allowed(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bit t % 32 of word t // 32, one token at a time."""
    out = np.zeros((bitmask.shape[0], vocab_size), dtype=bool)
    for row in range(bitmask.shape[0]):
        for token in range(vocab_size):
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
            out[row, token] = bool((word >> (token % 32)) & 1)
    return out


def random_bitmask(rows: int, vocab_size: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(-(2**31), 2**31, size=(rows, bitmask_words(vocab_size)), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,vocab_size", [(1, 1), (3, 31), (2, 32), (5, 33), (4, 97), (2, 1000), (1, 4099)])
def test_unpack_matches_the_per_token_reference(device, rows, vocab_size):
    bitmask = random_bitmask(rows, vocab_size, np.random.default_rng(vocab_size))
    bitmask[0, -1] = -1  # bit 31 set (the sign bit): the shift must not smear it into other bits
    got = unpack_token_bitmask(torch.from_numpy(bitmask).to(device), vocab_size).cpu().numpy()
    np.testing.assert_array_equal(got, reference_allowed(bitmask, vocab_size))
    if device == "cpu":
        np.testing.assert_array_equal(unpack_token_bitmask_host(bitmask, vocab_size), reference_allowed(bitmask, vocab_size))


@pytest.mark.parametrize("device", DEVICES)
def test_apply_masks_only_the_named_rows(device):
    vocab_size = 97
    rng = np.random.default_rng(0)
    logits = torch.randn(4, vocab_size, device=device)
    bitmask = random_bitmask(2, vocab_size, rng)
    masked = logits.clone()
    apply_token_bitmask_(masked, torch.from_numpy(bitmask).to(device), torch.tensor([3, 1], device=device))
    allowed = reference_allowed(bitmask, vocab_size)
    expected = logits.cpu().numpy().copy()
    for mask_row, row in ((0, 3), (1, 1)):
        expected[row][~allowed[mask_row]] = -np.inf
    np.testing.assert_array_equal(masked.cpu().numpy(), expected)


def test_a_bitmask_too_short_for_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="2 words"):
        unpack_token_bitmask(torch.zeros(1, 2, dtype=torch.int32), 65)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_sampler_draws_only_allowed_tokens(temperature):
    vocab_size, rows = 50, 6
    rng = np.random.default_rng(1)
    allowed_ids = [rng.choice(vocab_size, size=3, replace=False) for _ in range(rows)]
    bitmask = np.zeros((rows, bitmask_words(vocab_size)), dtype=np.int32)
    for row, ids in enumerate(allowed_ids):
        for token in ids:
            bitmask[row, token // 32] |= np.uint32(1 << (token % 32)).view(np.int32)
    params = [SamplingParams(temperature=temperature, seed=row) for row in range(rows)]
    # Row 5 is unconstrained: only rows 0-4 are masked.
    batch = SamplingBatch.build(params, [[1]] * rows, [[]] * rows, vocab_size, torch.device("cpu"),
                                grammar_masks=(list(range(5)), bitmask[:5]))
    assert batch.flags.grammar and not batch.flags.argmax_only
    sampler = Sampler(seed=0)
    for _ in range(20):
        logits = torch.randn(rows, vocab_size)
        tokens = sampler(logits, batch).token_ids.tolist()
        for row in range(5):
            assert tokens[row] in allowed_ids[row]


@pytest.mark.parametrize("rows,vocab_size", [(1, 1), (3, 31), (2, 32), (5, 33), (4, 97), (2, 1000)])
def test_one_tokens_bit_matches_the_per_token_reference(rows, vocab_size):
    bitmask = random_bitmask(rows, vocab_size, np.random.default_rng(vocab_size + 1))
    bitmask[-1, -1] = np.int32(-(2**31))  # only the sign bit of the last word
    expected = reference_allowed(bitmask, vocab_size)
    for row in range(rows):
        for token in range(vocab_size):
            assert token_allowed(bitmask, row, token) == expected[row, token], (row, token)
