"""What a draft-model proposal costs, and how often a self-speculative draft is right.

    python -m benchmarks draft-model [--num-speculative-tokens 4] [--batches 1,8] [--prompt-len 128] [--iterations 20]

Timing: for each draft (stories260K with all 5 layers; SmolLM2-135M-Instruct's first 2, 4 and 8
of 30 layers, and all 30 for scale) and batch size B, one session of the drafter's
DraftModelProposer opens B sequences of --prompt-len random tokens and proposes k tokens for
all of them (the first proposal, which computes the prompts, is reported on its own). Then
each iteration appends what a verifier would have accepted and proposes again, alternating
two cases: every draft accepted plus a bonus token (the K/V of k-1 fed drafts is kept, the
first forward computes 2 tokens a sequence) and none accepted (one corrected token, computed
alone). The iterations go round-robin over all cases, so load from other work falls on every
case alike. Reported: the median and the minimum milliseconds per proposal of each case (on a
shared machine the minimum is the steadier estimate of the cost itself). One intra-op
thread, as `tokenmill up` runs the drafter.

Acceptance: SmolLM2's own greedy continuation of two text prompts (from the full-depth draft,
which is the target's forward), then the first-N-layer draft (N in 2, 4, 8, 16, 24) proposes k tokens at each step;
the longest prefix equal to the target's continues plus one target token are accepted, as a
greedy verifier would. Reported: the share of drafted tokens accepted and the mean tokens per
verification step (accepted + 1).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from benchmarks.harness import flags, report
from benchmarks.harness.flags import config_field, setting
from benchmarks.harness.paths import SMOLLM2, STORIES
from services.drafter.config import DraftModelSettings, DrafterConfig
from services.drafter.draft_model import DraftModelProposer

PROG = "python -m benchmarks draft-model"
TEXTS = ["The water cycle is the continuous movement of water on, above and below the surface of the Earth. "
         "It begins when the sun heats",
         "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
ACCEPTANCE_LAYERS = (2, 4, 8, 16, 24)


@dataclass(frozen=True, slots=True)
class DraftModelBenchSettings:
    num_speculative_tokens: int = config_field(DrafterConfig, "num_speculative_tokens", default=4,
                                               note="(k: tokens each proposal drafts)")
    batches: tuple[int, ...] = setting((1, 8))
    """Sequences per proposal session, comma-separated."""
    prompt_len: int = setting(128)
    """Random prompt tokens of each timed sequence."""
    iterations: int = setting(20)
    """Timed proposals per case (alternating all accepted / none accepted)."""
    continuation: int = setting(48)
    """Target tokens per acceptance prompt."""
    threads: int = setting(1)
    """torch intra-op threads (the drafter runs with one)."""
    skip_acceptance: bool = setting(False)
    """Time the proposals only."""
    json: Path | None = setting(None)
    """Result file (none: benchmarks/results/draft-model-DATE.json)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "num_speculative_tokens", "prompt_len", "iterations", "continuation", "threads")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"--batches must be positive, got {self.batches}")


def make(model, layers: int, k: int) -> DraftModelProposer:
    return DraftModelProposer(DraftModelSettings(draft_model=str(model), draft_layers=layers, device="cpu"), k)


class ProposalTimer:
    """B sequences of random tokens in one session, proposed for again and again."""

    def __init__(self, proposer: DraftModelProposer, batch: int, prompt_len: int) -> None:
        rng = random.Random(0)
        self.session = proposer.new_session()
        self.ids = list(range(batch))
        for seq_id in self.ids:
            self.session.open(seq_id, [rng.randrange(3, proposer.vocab_size) for _ in range(prompt_len)])
        self.first_ms = self._timed()
        self.timings: dict[str, list[float]] = {"all_accepted": [], "none_accepted": []}

    def _timed(self) -> float:
        started = time.perf_counter()
        self.drafts = self.session.propose_batch(self.ids)
        return 1e3 * (time.perf_counter() - started)

    def iterate(self, case: str) -> None:
        """Append what a verifier would accept in ``case``, then time the next proposal."""
        for seq_id, draft in zip(self.ids, self.drafts):
            self.session.append(seq_id, draft + [draft[0]] if case == "all_accepted" else [(draft[0] + 1) % 100 + 3])
        self.timings[case].append(self._timed())

    def row(self) -> dict:
        self.session.close_all()
        row = {"first_ms": self.first_ms}
        for case, times in self.timings.items():
            row[f"{case}_ms"] = statistics.median(times)
            row[f"{case}_min_ms"] = min(times)
        return row


def time_proposals(proposer: DraftModelProposer, batch: int, prompt_len: int, iterations: int) -> dict:
    timer = ProposalTimer(proposer, batch, prompt_len)
    for i in range(iterations):
        timer.iterate("all_accepted" if i % 2 == 0 else "none_accepted")
    return timer.row()


def greedy_continuation(proposer: DraftModelProposer, prompt: list[int], length: int) -> list[int]:
    session = proposer.new_session()
    session.open(0, prompt)
    out: list[int] = []
    while len(out) < length:
        (token,) = session.propose_batch([0], num_tokens=1)[0]
        out.append(token)
        session.append(0, [token])
    session.close_all()
    return out


def acceptance(proposer: DraftModelProposer, prompt: list[int], target: list[int], k: int) -> tuple[int, int, int]:
    """(drafted, accepted, verification steps) of greedy verification along ``target``."""
    session = proposer.new_session()
    session.open(0, prompt)
    pos = drafted = accepted = steps = 0
    while pos < len(target):
        draft = session.propose_batch([0], num_tokens=min(k, len(target) - pos))[0]
        match = 0
        while match < len(draft) and draft[match] == target[pos + match]:
            match += 1
        gained = target[pos : pos + match + 1]
        drafted, accepted, steps = drafted + len(draft), accepted + match, steps + 1
        session.append(0, gained)
        pos += len(gained)
    session.close_all()
    return drafted, accepted, steps


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = flags.parse(DraftModelBenchSettings, argv, prog=prog, description=__doc__)
    k = args.num_speculative_tokens
    torch.set_num_threads(args.threads)
    batches = list(args.batches)
    results: dict = report.provenance(report.command_line(prog, argv)) | {
        "k": k, "prompt_len": args.prompt_len, "threads": args.threads, "timing": [], "acceptance": []}
    cases = [("stories260K", STORIES, 0)] + [("smollm2-135m", SMOLLM2, n) for n in (2, 4, 8, 30)]
    proposers = [(name, make(model, layers, k)) for name, model, layers in cases]
    timers = [(name, proposer, batch, ProposalTimer(proposer, batch, args.prompt_len))
              for name, proposer in proposers for batch in batches]
    # Round-robin over the cases, so load from other work on the machine falls on all of them alike.
    for i in range(args.iterations):
        for *_, timer in timers:
            timer.iterate("all_accepted" if i % 2 == 0 else "none_accepted")
    print(f"k={k}, prompt {args.prompt_len} tokens, {args.threads} thread(s): ms per proposal, "
          f"median (min) of {args.iterations // 2} each")
    print(f"{'draft':<14}{'layers':>7}{'batch':>6}{'first':>9}{'all accepted':>20}{'none accepted':>20}")
    for name, proposer, batch, timer in timers:
        row = {"draft": name, "layers": proposer.model_config.num_layers, "batch": batch, **timer.row()}
        results["timing"].append(row)
        print(f"{name:<14}{row['layers']:>7}{batch:>6}{row['first_ms']:>9.1f}"
              f"{row['all_accepted_ms']:>11.2f} ({row['all_accepted_min_ms']:>6.2f})"
              f"{row['none_accepted_ms']:>11.2f} ({row['none_accepted_min_ms']:>6.2f})")
    del proposers, timers
    if not args.skip_acceptance:
        acceptance_table(k, args.continuation, results)
    path = report.write_result(results, report.result_path("draft-model", args.json))
    print(f"result: {path}")
    return 0


def acceptance_table(k: int, continuation: int, results: dict) -> None:
    tokenizer = Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in TEXTS]
    full = make(SMOLLM2, 0, k)
    targets = [greedy_continuation(full, prompt, continuation) for prompt in prompts]
    del full
    print(f"\nSmolLM2 self-speculative acceptance along its own greedy text ({len(prompts)} prompts x "
          f"{continuation} tokens, k={k})")
    for layers in ACCEPTANCE_LAYERS:
        proposer = make(SMOLLM2, layers, k)
        drafted = accepted = steps = 0
        for prompt, target in zip(prompts, targets):
            d, a, s = acceptance(proposer, prompt, target, k)
            drafted, accepted, steps = drafted + d, accepted + a, steps + s
        row = {"layers": layers, "acceptance_rate": accepted / drafted,
               "tokens_per_step": (accepted + steps) / steps}
        results["acceptance"].append(row)
        print(f"  first {layers} layers: {100 * row['acceptance_rate']:.1f}% of drafted tokens accepted, "
              f"{row['tokens_per_step']:.2f} tokens per verification step", flush=True)

