"""Sampler: each stage against a plain NumPy reference, then greedy, seeding, frequencies, logprobs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from services.runtime.sampling.batch import SamplingBatch, derive_row_seed, is_plain_greedy
from services.common.sampling_params import SamplingParams
from services.common.step import MinTokensBan
from services.runtime.sampling.sampler import Sampler, process_logits

CPU = torch.device("cpu")


# ---------------------------------------------------------------- NumPy references (float64)


def ref_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


def ref_penalties(
    logits: np.ndarray, p: SamplingParams, prompt: Sequence[int], output: Sequence[int], ban: MinTokensBan | None = None
) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for token, bias in p.logit_bias.items():
        out[token] += bias
    if ban is not None and len(output) < ban.min_tokens:
        for token in ban.token_ids:
            out[token] = -np.inf
    for token in set(prompt) | set(output):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token, count in Counter(output).items():
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    return out


def ref_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    probs = ref_softmax(logits)
    return np.where(probs >= min_p * probs.max(), logits, -np.inf)


def ref_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k == 0:
        return logits
    kth = sorted(logits, reverse=True)[min(k, len(logits)) - 1]
    return np.where(logits >= kth, logits, -np.inf)


def ref_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Smallest most-likely-first prefix reaching top_p, widened to every token tied with its last."""
    if top_p >= 1.0:
        return logits
    probs = ref_softmax(logits)
    mass, last = 0.0, None
    for token in sorted(range(len(logits)), key=lambda t: -probs[t]):
        mass += probs[token]
        last = token
        if mass >= top_p:
            break
    return np.where(logits >= logits[last], logits, -np.inf)


def ref_process(logits: np.ndarray, p: SamplingParams, prompt=(), output=(), ban=None) -> np.ndarray:
    out = ref_penalties(logits, p, prompt, output, ban)
    if p.is_greedy:
        return out
    out = out / p.temperature
    return ref_top_p(ref_top_k(ref_min_p(out, p.min_p), p.top_k), p.top_p)


# ---------------------------------------------------------------- helpers


def make_batch(params, prompts=None, outputs=None, vocab_size=16, bans=None) -> SamplingBatch:
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingBatch.build(params, prompts, outputs, vocab_size, CPU, bans)


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def assert_matches_reference(processed_row: torch.Tensor, reference: np.ndarray) -> None:
    got = processed_row.double().numpy()
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(reference))
    finite = np.isfinite(reference)
    np.testing.assert_allclose(got[finite], reference[finite], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- each stage vs reference

# Logits in multiples of 1/8 so the additive stages are exact in float32.
BASE = np.array([2.5, -1.25, 0.75, 3.0, -0.5, 1.5, 0.0, -2.0, 1.0, 0.25, -3.5, 2.0, 0.5, -0.75, 1.75, -1.5])


@pytest.mark.parametrize(
    "params, ban, prompt, output",
    [
        (SamplingParams(logit_bias={0: 5.0, 7: -100.0, 15: 0.5}), None, [], []),
        (SamplingParams(), MinTokensBan(3, (3, 11)), [], [1, 2]),  # ban active
        (SamplingParams(), MinTokensBan(2, (3, 11)), [], [1, 2]),  # ban lifted
        (SamplingParams(repetition_penalty=1.5), None, [0, 1, 1, 6], [3, 4, 4]),  # pos, neg, zero logits
        (SamplingParams(repetition_penalty=0.5), None, [7, 5], [5, 5]),  # < 1 rewards repeats
        (SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), None, [0, 0], [3, 3, 3, 2, 9]),
        (SamplingParams(frequency_penalty=-1.0, presence_penalty=2.0), None, [], [1, 1]),
        (
            SamplingParams(logit_bias={4: 2.0}, repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5),
            MinTokensBan(5, (0,)),
            [4, 8],
            [4, 4, 12],
        ),
    ],
)
def test_penalty_stages_match_reference(params, ban, prompt, output):
    batch = make_batch([params], [prompt], [output], bans=[ban])
    processed = process_logits(torch.tensor(BASE, dtype=torch.float32)[None], batch)
    assert_matches_reference(processed.logits[0], ref_penalties(BASE, params, prompt, output, ban))


def test_penalty_stages_hand_computed():
    # Repetition 2 on token 0 (2.5 -> 1.25) and token 1 (-1.25 -> -2.5); token 3 banned;
    # token 5 generated twice with frequency 0.5 + presence 0.25: 1.5 - 1.0 - 0.25 = 0.25.
    params = SamplingParams(repetition_penalty=2.0)
    params2 = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    batch = make_batch([params, params2], [[0, 1], []], [[], [5, 5]], bans=[MinTokensBan(9, (3,)), None])
    logits = torch.tensor(np.stack([BASE, BASE]), dtype=torch.float32)
    out = process_logits(logits, batch).logits
    assert out[0, 0].item() == 1.25 and out[0, 1].item() == -2.5 and out[0, 3].item() == float("-inf")
    assert out[1, 5].item() == 0.25
    assert torch.equal(out[0, 4:], logits[0, 4:]) and torch.equal(out[1, :5], logits[1, :5])


@pytest.mark.parametrize(
    "params, expected_kept",
    [
        # top-k: sorted logits 3.0 (3), 2.5 (0), 2.0 (11), 1.75 (14)
        (SamplingParams(top_k=3), {3, 0, 11}),
        (SamplingParams(top_k=1), {3}),
        (SamplingParams(top_k=100), set(range(16))),
        # min-p 0.3 at T=1: keep l >= 3.0 + ln 0.3 = 1.796
        (SamplingParams(min_p=0.3), {3, 0, 11}),
        # min-p 0.3 at T=0.5: keep l/T >= 6.0 + ln 0.3, i.e. l >= 2.398
        (SamplingParams(min_p=0.3, temperature=0.5), {3, 0}),
        # top-p: sorted probs 0.333, 0.202, 0.122, 0.095; prefix sums 0.333, 0.534, 0.656
        (SamplingParams(top_p=0.05), {3}),
        (SamplingParams(top_p=0.5), {3, 0}),
        (SamplingParams(top_p=0.6), {3, 0, 11}),
        # top-p after top-k 3 sees renormalized probs 0.507, 0.307, 0.186: 0.6 needs two
        (SamplingParams(top_k=3, top_p=0.6), {3, 0}),
        (SamplingParams(top_k=2, top_p=1.0), {3, 0}),
        # rounds to 1.0 in float32: top-p keeps the whole (top-k masked) tail, top-k must still hold
        (SamplingParams(top_k=2, top_p=0.99999999), {3, 0}),
    ],
)
def test_truncation_hand_computed_and_reference(params, expected_kept):
    batch = make_batch([params])
    processed = process_logits(torch.tensor(BASE, dtype=torch.float32)[None], batch)
    assert kept(processed.logits[0]) == expected_kept
    reference = ref_process(BASE, params)
    assert_matches_reference(processed.logits[0], reference)
    np.testing.assert_allclose(processed.probs[0].double().numpy(), ref_softmax(reference), atol=1e-6)


def test_top_k_keeps_every_token_tied_at_the_boundary():
    logits = np.array([3.0, 2.0, 2.0, 1.0, 2.0, 0.0])
    batch = make_batch([SamplingParams(top_k=2)], vocab_size=6)
    assert kept(process_logits(torch.tensor(logits, dtype=torch.float32)[None], batch).logits[0]) == {0, 1, 2, 4}
    assert set(np.flatnonzero(np.isfinite(ref_top_k(logits, 2)))) == {0, 1, 2, 4}


def test_top_p_keeps_every_token_tied_at_the_boundary():
    # p = softmax: token 0 has ~0.47, tokens 1, 2, 3 ~0.17 each (tied). top_p = 0.7 is reached
    # after two of the tied tokens; the cut is a value, so the third tied token stays.
    logits = np.array([2.0, 1.0, 1.0, 1.0, -1.0, -2.0])
    probs = ref_softmax(logits)
    assert probs[0] + probs[1] < 0.7 < probs[0] + 2 * probs[1]
    batch = make_batch([SamplingParams(top_p=0.7)], vocab_size=6)
    processed = process_logits(torch.tensor(logits, dtype=torch.float32)[None], batch)
    assert kept(processed.logits[0]) == {0, 1, 2, 3}
    assert_matches_reference(processed.logits[0], ref_top_p(logits, 0.7))


def test_top_p_that_rounds_to_one_keeps_the_whole_tail():
    # The leading token's probability rounds to 1.0 in float32, so the tail's prefix mass
    # equals 1.0; a top_p that also rounds to 1.0 must not drop the (tiny but nonzero) tail.
    logits = torch.tensor([[20.0] + [0.0] * 15])
    batch = make_batch([SamplingParams(top_p=0.99999999)])
    assert batch.flags.top_p
    assert kept(process_logits(logits, batch).logits[0]) == set(range(16))


def test_full_pipeline_matches_reference_on_a_mixed_batch():
    rng = np.random.default_rng(7)
    vocab = 50
    params = [
        SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
        SamplingParams(temperature=1.3, top_p=0.8, frequency_penalty=0.4, presence_penalty=-0.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logit_bias={3: 4.0}),
        SamplingParams(temperature=1.0, min_p=0.1, logit_bias={7: -5.0, 9: 3.0}),
        SamplingParams(temperature=0.5, top_k=5),
        SamplingParams(),
    ]
    bans = [None, None, None, MinTokensBan(4, (1, 2)), None, None]
    prompts = [rng.integers(0, vocab, 12).tolist() for _ in params]
    outputs = [rng.integers(0, vocab, n).tolist() for n in (5, 8, 3, 2, 0, 6)]
    logits = rng.normal(0.0, 2.0, (len(params), vocab)).astype(np.float32)
    batch = SamplingBatch.build(params, prompts, outputs, vocab, CPU, bans)
    assert batch.top_p_rows.tolist() == [0, 1]  # only those rows are sorted
    processed = process_logits(torch.from_numpy(logits), batch)
    for row, p in enumerate(params):
        reference = ref_process(logits[row].astype(np.float64), p, prompts[row], outputs[row], bans[row])
        if p.is_greedy:  # greedy rows are not tempered or truncated; only their argmax matters
            assert_matches_reference(processed.logits[row], reference)
            continue
        assert_matches_reference(processed.logits[row], reference)
        np.testing.assert_allclose(processed.probs[row].double().numpy(), ref_softmax(reference), atol=1e-6)


# ---------------------------------------------------------------- greedy and the fast path


def test_greedy_is_argmax_of_penalized_logits():
    rng = np.random.default_rng(3)
    logits = rng.normal(0.0, 1.0, (4, 32)).astype(np.float32)
    top = logits.argmax(axis=1)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=3.0),
        SamplingParams(temperature=0.0, logit_bias={int(top[1]): -100.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=4),  # a sampling row beside them
    ]
    bans = [None, None, MinTokensBan(1, (int(top[2]),)), None]
    prompts = [[int(top[0])], [], [], []]
    batch = SamplingBatch.build(params, prompts, [[], [], [], []], 32, CPU, bans)
    tokens = Sampler(seed=0)(torch.from_numpy(logits), batch).token_ids
    for row in range(3):
        expected = int(np.argmax(ref_penalties(logits[row], params[row], prompts[row], [], bans[row])))
        assert expected != top[row]  # the penalty changed the answer
        assert tokens[row].item() == expected


def test_greedy_fast_path_equals_general_path():
    rng = np.random.default_rng(5)
    logits = torch.from_numpy(rng.normal(0.0, 1.0, (8, 100)).astype(np.float32)).to(torch.bfloat16)
    fast = make_batch([SamplingParams(temperature=0.0)] * 8, vocab_size=100)
    assert fast.flags.argmax_only
    # Same rows with a no-op bias and logprobs force the general path.
    general = make_batch([SamplingParams(temperature=0.0, logit_bias={0: 0.0}, logprobs=0)] * 8, vocab_size=100)
    assert not general.flags.argmax_only
    sampler = Sampler(seed=0)
    fast_tokens = sampler(logits, fast).token_ids
    assert torch.equal(fast_tokens, sampler(logits, general).token_ids)
    assert torch.equal(fast_tokens, logits.float().argmax(dim=-1))
    assert fast_tokens.dtype == torch.int64


# One field at a time off the plain greedy row; each must leave the argmax-only path.
NOT_PLAIN_GREEDY = [
    ({"temperature": 0.7}, None, 0),
    ({"temperature": 0.0, "logit_bias": {3: 0.0}}, None, 0),
    ({"temperature": 0.0, "repetition_penalty": 1.1}, None, 0),
    ({"temperature": 0.0, "presence_penalty": 0.5}, None, 0),
    ({"temperature": 0.0, "frequency_penalty": -0.5}, None, 0),
    ({"temperature": 0.0, "logprobs": 0}, None, 0),
    ({"temperature": 0.0}, MinTokensBan(2, (1,)), 1),  # ban in force: 1 output token of 2
]
PLAIN_GREEDY = [
    ({"temperature": 0.0}, None, 0),
    ({"temperature": 1e-6}, None, 5),  # below the sampling threshold: greedy
    ({"temperature": 0.0, "top_k": 3, "top_p": 0.5, "min_p": 0.1, "seed": 7}, None, 0),  # no effect when greedy
    ({"temperature": 0.0}, MinTokensBan(2, (1,)), 2),  # ban lifted
    ({"temperature": 0.0}, MinTokensBan(4, ()), 0),  # bans nothing
]


@pytest.mark.parametrize("kwargs, ban, num_output", NOT_PLAIN_GREEDY + PLAIN_GREEDY)
def test_plain_greedy_row_is_the_per_row_argmax_only_flag(kwargs, ban, num_output):
    params = SamplingParams(**kwargs)
    plain = (kwargs, ban, num_output) in PLAIN_GREEDY
    assert is_plain_greedy(params, num_output, ban) == plain
    # Alone, and beside a plain greedy row: the batch is argmax-only exactly when every row is plain.
    for rows in ([params], [SamplingParams(temperature=0.0), params]):
        bans = [None] * (len(rows) - 1) + [ban]
        outputs = [[]] * (len(rows) - 1) + [[0] * num_output]
        assert make_batch(rows, outputs=outputs, bans=bans).flags.argmax_only == plain


def test_caller_logits_are_not_modified():
    logits = torch.tensor(BASE, dtype=torch.float32)[None]
    before = logits.clone()
    batch = make_batch([SamplingParams(repetition_penalty=2.0, top_k=2, temperature=0.5)], [[0, 3]], [[1]])
    Sampler(seed=0)(logits, batch)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- seeded reproducibility


def step_logits(history: list[int], vocab: int) -> torch.Tensor:
    """A stand-in model: logits that depend on the sequence's own history only."""
    generator = torch.Generator().manual_seed(1000 + sum((i + 1) * t for i, t in enumerate(history)))
    return torch.randn(vocab, generator=generator)


def run_seeded(seed: int, row: int, others: list[SamplingParams], shared_seed: int, steps: int = 8) -> list[int]:
    """Decode the probe request at ``row`` among ``others`` for several steps; return its tokens."""
    vocab = 64
    probe = SamplingParams(temperature=1.5, top_k=40, repetition_penalty=1.1, seed=seed)
    params = others[:row] + [probe] + others[row:]
    histories: list[list[int]] = [[] for _ in params]
    sampler = Sampler(seed=shared_seed)
    for _ in range(steps):
        batch = SamplingBatch.build(params, [[1, 2, 3]] * len(params), histories, vocab, CPU)
        logits = torch.stack([step_logits(h, vocab) for h in histories])  # [B, V]
        for history, token in zip(histories, sampler(logits, batch).token_ids.tolist()):
            history.append(token)
    return histories[row]


def test_seeded_request_is_independent_of_batch_composition():
    alone = run_seeded(seed=1234, row=0, others=[], shared_seed=0)
    crowd_a = [SamplingParams(seed=7), SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)]
    crowd_b = [SamplingParams() for _ in range(5)] + [SamplingParams(seed=1234 + 1, top_k=3)]
    in_crowd_a = run_seeded(seed=1234, row=2, others=crowd_a, shared_seed=1)
    in_crowd_b = run_seeded(seed=1234, row=6, others=crowd_b, shared_seed=99)
    assert alone == in_crowd_a == in_crowd_b
    assert len(set(alone)) > 3  # really sampled, not a constant
    assert run_seeded(seed=4321, row=0, others=[], shared_seed=0) != alone


def test_derived_seed_depends_on_seed_and_position_only():
    assert derive_row_seed(5, 3) == derive_row_seed(5, 3)
    seeds = {derive_row_seed(seed, position) for seed in range(50) for position in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 2**63 for s in seeds)
    assert 0 <= derive_row_seed(-1, 0) < 2**63 and 0 <= derive_row_seed(2**70, 2**40) < 2**63


# ---------------------------------------------------------------- draws follow the processed distribution

FREQ_LOGITS = np.array([1.0, 0.6, 0.3, 0.2, -0.1, -0.4, -0.8, -2.5])


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    support = probs > 0
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_frequencies_match_processed_distribution(seeded):
    draws = 4000
    base = dict(temperature=0.8, top_k=6, top_p=0.95, min_p=0.05)
    # Seeded: every row its own seed, so the rows are independent draws through derive_row_seed.
    params = [SamplingParams(**base, seed=i if seeded else None) for i in range(draws)]
    batch = make_batch(params, vocab_size=8)
    logits = torch.tensor(FREQ_LOGITS, dtype=torch.float32).expand(draws, 8).contiguous()
    probs = process_logits(logits[:1], make_batch(params[:1], vocab_size=8)).probs[0].double().numpy()
    counts = np.bincount(Sampler(seed=11)(logits, batch).token_ids.numpy(), minlength=8)
    assert np.all(counts[probs == 0] == 0)
    support = int((probs > 0).sum())
    assert support >= 4  # the test exercises a real choice
    # 99.9% quantile of chi-square with support - 1 <= 5 degrees of freedom is < 20.6.
    assert chi_square(counts, probs) < 20.6


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.6), {0, 1, 2}),
        (SamplingParams(min_p=0.5, temperature=2.0), {0, 1, 2}),
    ],
)
def test_truncated_tokens_are_never_drawn(params, allowed):
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.2, 0.1, 0.0, -0.1], dtype=torch.float32)
    draws = 2000
    batch = make_batch([params] * draws, vocab_size=8)
    tokens = Sampler(seed=3)(logits.expand(draws, 8).contiguous(), batch).token_ids
    assert set(tokens.tolist()) == allowed  # nothing outside, and every allowed token appears


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_n_sorted():
    rng = np.random.default_rng(9)
    logits = torch.from_numpy(rng.normal(0.0, 2.0, (4, 40)).astype(np.float32))
    params = [
        SamplingParams(temperature=0.6, top_k=5, repetition_penalty=1.4, logprobs=3),
        SamplingParams(temperature=0.0, logit_bias={0: 50.0}, logprobs=5),
        SamplingParams(logprobs=0),
        SamplingParams(),
    ]
    batch = SamplingBatch.build(params, [[1, 2]] * 4, [[3]] * 4, 40, CPU)
    out = Sampler(seed=0)(logits, batch)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.token_ids[1].item() == 0  # the bias moved the greedy choice ...
    torch.testing.assert_close(out.logprobs.double(), raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_token_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    expected_values, expected_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.top_token_ids, expected_ids)
    torch.testing.assert_close(out.top_logprobs.double(), expected_values)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])

    rows = out.to_lists(batch)
    assert [token for token, _ in rows] == out.token_ids.tolist()
    assert rows[0][1].top_token_ids == expected_ids[0, :3].tolist() and len(rows[0][1].top_logprobs) == 3
    assert len(rows[1][1].top_token_ids) == 5
    assert rows[1][1].logprob == pytest.approx(raw[1, 0].item(), abs=1e-6)  # ... not its logprob
    assert rows[2][1].top_token_ids == [] and rows[2][1].top_logprobs == []
    assert rows[2][1].logprob == pytest.approx(raw[2, rows[2][0]].item(), abs=1e-6)
    assert rows[3][1] is None


def test_logprobs_zero_returns_only_the_sampled_logprob():
    batch = make_batch([SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0)])
    out = Sampler(seed=0)(torch.tensor(np.stack([BASE, -BASE]), dtype=torch.float32), batch)
    assert out.top_token_ids is None and out.top_logprobs is None
    assert out.logprobs.shape == (2,)
    rows = out.to_lists(batch)
    assert rows[0][0] == 3 and rows[0][1].logprob == pytest.approx(float(np.log(ref_softmax(BASE)[3])), abs=1e-6)
    assert rows[1] == (10, None)


def test_no_logprobs_requested_returns_none():
    out = Sampler(seed=0)(torch.tensor(BASE, dtype=torch.float32)[None], make_batch([SamplingParams(top_k=2)]))
    assert out.logprobs is None and out.top_token_ids is None
    assert out.to_lists(make_batch([SamplingParams(top_k=2)]))[0][1] is None


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        # Accepted before and sampled noise: infinite or astronomically large values.
        (dict(temperature=float("inf")), r"temperature must be in \[0, 100\] \(0 = greedy\), got inf"),
        (dict(temperature=1e308), "temperature"),
        (dict(repetition_penalty=float("inf")), r"repetition_penalty must be in \(0, 100\], got inf"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(logit_bias={16: 1.0}), "logit_bias"),
        (dict(logit_bias={1: 101.0}), "logit_bias"),
        (dict(logprobs=21), "logprobs"),
    ],
)
def test_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate(vocab_size=16)


def test_build_and_call_reject_inconsistent_inputs():
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingBatch.build([SamplingParams()], [[]], [], 16, CPU)
    with pytest.raises(ValueError, match="output_token_ids holds token id 16"):
        make_batch([SamplingParams(frequency_penalty=1.0)], [[]], [[2, 16]])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        make_batch([SamplingParams(repetition_penalty=1.2)], [[-1]], [[]])
    with pytest.raises(ValueError, match="min_tokens_ban holds token id 16"):
        make_batch([SamplingParams()], bans=[MinTokensBan(2, (3, 16))])
    with pytest.raises(ValueError, match="min_tokens_bans has 2 rows"):
        make_batch([SamplingParams()], bans=[None, None])
    with pytest.raises(ValueError, match="logits shape"):
        Sampler()(torch.zeros(2, 16), make_batch([SamplingParams()]))
    with pytest.raises(ValueError, match="floating-point"):
        Sampler()(torch.zeros(1, 16, dtype=torch.int64), make_batch([SamplingParams()]))
