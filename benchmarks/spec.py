"""Speculative decoding through the four services on SmolLM2-135M-Instruct: off, n-gram, draft model.

    python -m benchmarks spec [--rounds 2] [--tokens 128] [--draft-layers 4]   (make bench-spec)

Three stacks run side by side, started as `tokenmill up` starts them (the Launcher: four
processes, one OpenMP thread each; fp32 on a CPU): the scheduler without a drafter
(--num-speculative-tokens 0), with the n-gram drafter, and with the self-speculative draft
model (the target's first --draft-layers layers plus its final norm and head), both at up to
--num-speculative-tokens (8) drafts per step with adaptive k. Only one stack works at a time;
the stacks take turns per measurement, so load from other work on the machine falls on all
three alike, and the speedups are ratios within one run.

Two workloads of greedy chat requests, batch 1 (requests one after another) and batch 8
(eight at once):
- copy: "repeat this passage exactly" over a supplied paragraph (where prompt lookup pays,
  like code editing and answers grounded in a document);
- free: open-ended writing on a topic (where it does not).

Per (system, workload, batch): output tokens per second of wall time, the share of draft
tokens accepted and the mean accepted length (tokens per drafted step), from the scheduler's
/metrics counters over the measurement. The JSON result (benchmarks/results/spec-COMMIT.json)
carries every figure and ``spec_speedup_ngram_copy_b1`` / ``spec_speedup_ngram_free_b1``
(tokens/s with n-gram over tokens/s without speculation, same run: the median over rounds of
the ratio of the two measurements taken back to back).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from contextlib import AsyncExitStack as ExitStackAsync, ExitStack
from dataclasses import dataclass

from benchmarks.harness import flags, report
from benchmarks.harness.client import generation_stub, stream_ok
from benchmarks.harness.flags import config_field, setting
from benchmarks.harness.launch import LaunchSpec, Stack, launched
from benchmarks.harness.models import require
from benchmarks.harness.paths import SMOLLM2
from benchmarks.harness.scrape import scrape
from services.drafter.config import DraftModelSettings
from services.scheduler.config import SpeculationSettings
from services.stack.client import build_request

PROG = "python -m benchmarks spec"
MODEL = SMOLLM2
SYSTEMS = ("off", "ngram", "draft")
WORKLOADS = ("copy", "free")

PASSAGES = [
    "The river town of Alder Ford was built where the old trade road crossed the water. Every spring the "
    "snowmelt raised the river until it touched the lowest step of the mill, and every autumn the farmers "
    "brought their grain to be ground before the first frost. The miller kept a ledger of each sack, and "
    "the ledger is still kept in the town hall today.",
    "To replace a bicycle tire, first shift to the smallest gear and open the brake. Loosen the axle nut or "
    "the quick release and remove the wheel. Push one side of the tire into the rim, lever it off with two "
    "tire levers, and pull out the old tube. Check the inside of the tire for glass or thorns before you "
    "fit the new tube, then inflate it slowly.",
    "Our library opens at nine in the morning and closes at six in the evening from Monday to Friday. On "
    "Saturdays it opens at ten and closes at four. Books may be borrowed for three weeks and renewed twice, "
    "online or at the front desk. Late returns cost ten cents a day, and lost cards can be replaced for two "
    "dollars.",
    "Photosynthesis takes place in the chloroplasts of plant cells. Light energy is absorbed by chlorophyll "
    "and used to split water into oxygen, protons and electrons. The electrons pass along a transport chain "
    "that makes ATP and NADPH, which the Calvin cycle then uses to fix carbon dioxide into sugars that the "
    "plant can store or burn for energy.",
]
TOPICS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Write a poem about the sea at night.",
    "Describe your ideal weekend in a few paragraphs.",
    "Write a letter to a friend about a trip to the mountains.",
]
SPEC_METRICS = ("tokenmill:spec_decode_num_drafts", "tokenmill:spec_decode_num_draft_tokens",
                "tokenmill:spec_decode_num_accepted_tokens")


def messages(workload: str, index: int) -> list[dict[str, str]]:
    if workload == "copy":
        text = PASSAGES[index % len(PASSAGES)]
        return [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{text}"}]
    return [{"role": "user", "content": TOPICS[index % len(TOPICS)]}]


@dataclass(frozen=True, slots=True)
class SpecSettings:
    rounds: int = setting(2)
    """Measurements of every case, alternating the order of the systems."""
    tokens: int = setting(128)
    """Max output tokens per request."""
    draft_layers: int = config_field(DraftModelSettings, "draft_layers", default=4)
    num_speculative_tokens: int = config_field(
        SpeculationSettings, "num_speculative_tokens", default=8,
        note="Given to the scheduler and the drafter of the ngram and draft systems alike.")
    systems: tuple[str, ...] = setting(SYSTEMS, choices=SYSTEMS)
    """Which systems to run, comma-separated."""
    workloads: tuple[str, ...] = setting(WORKLOADS, choices=WORKLOADS)
    """Which workloads to run, comma-separated."""
    batches: tuple[int, ...] = setting((1, 8))
    """Requests at once per measurement (1: two one after the other)."""
    out: str = setting("")
    """Result JSON (empty: benchmarks/results/spec-COMMIT.json)."""

    def validate(self) -> None:
        flags.check_choices("systems", self.systems, SYSTEMS)
        flags.check_choices("workloads", self.workloads, WORKLOADS)
        flags.check_at_least(self, 1, "rounds", "tokens", "num_speculative_tokens")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"--batches must be positive, got {self.batches}")

    def launch(self, name: str) -> LaunchSpec:
        k = self.num_speculative_tokens
        spec = () if name == "off" else (f"--num-speculative-tokens={k}",)
        drafter = (f"--num-speculative-tokens={k}",) + (
            ("--method=draft_model", f"--draft-model={MODEL}", f"--draft-layers={self.draft_layers}")
            if name == "draft" else ())
        # three executors warming up at once on a busy machine: a long start timeout
        return LaunchSpec(str(MODEL), executor_args=(f"--kv-cache-bytes={512 * 1024**2}",), scheduler_args=spec,
                          drafter_args=drafter, threads=1, quiet=False, start_timeout_s=900,
                          log_prefix=f"spec-bench-{name}-")


class System:
    def __init__(self, name: str, stack: Stack, tokens: int) -> None:
        self.name = name
        self.stack = stack
        self.tokens = tokens

    def counters(self) -> dict[str, float]:
        samples = scrape(self.stack.scheduler_metrics)
        return {name: samples.get(name + "_total", 0.0) for name in SPEC_METRICS}

    async def run(self, stub, workload: str, batch: int, offset: int) -> dict:
        """Batch 1: two requests one after the other; batch 8: eight at once."""
        before = self.counters()
        started = time.perf_counter()
        if batch == 1:
            tokens = [await one(stub, messages(workload, offset + i), self.tokens) for i in range(2)]
        else:
            tokens = await asyncio.gather(*(one(stub, messages(workload, offset + i), self.tokens)
                                            for i in range(batch)))
        wall = time.perf_counter() - started
        after = self.counters()
        delta = {name.removeprefix("tokenmill:spec_decode_"): after[name] - before[name] for name in SPEC_METRICS}
        return {"tokens": sum(tokens), "seconds": wall, **delta}


async def one(stub, chat: list[dict[str, str]], max_tokens: int) -> int:
    record = await stream_ok(stub, build_request(None, chat=chat, max_tokens=max_tokens, temperature=0.0), timeout=900)
    return record.num_output_tokens


async def measure(systems: list[System], rounds: int, workloads=WORKLOADS, batches=(1, 8)) -> dict:
    async with ExitStackAsync() as channels:
        stubs = [await channels.enter_async_context(generation_stub(s.stack.address)) for s in systems]
        return await _measure(systems, stubs, rounds, workloads, batches)


async def _measure(systems: list[System], stubs: list, rounds: int, workloads, batches) -> dict:
    for system, stub in zip(systems, stubs):
        await system.run(stub, "free", 1, 0)  # warm up (one-time costs, first allocations)
    raw: dict[str, list[dict]] = {}
    for round_ in range(rounds):
        for workload in workloads:
            for batch in batches:
                order = list(zip(systems, stubs))
                if round_ % 2:
                    order.reverse()
                for system, stub in order:
                    row = await system.run(stub, workload, batch, round_)
                    raw.setdefault(f"{system.name}_{workload}_b{batch}", []).append(row)
                    print(f"round {round_ + 1} {system.name:>5} {workload} b{batch}: {row['tokens']} tokens in "
                          f"{row['seconds']:.1f} s, {row['tokens'] / row['seconds']:.1f} tok/s, accepted "
                          f"{row['num_accepted_tokens']:.0f}/{row['num_draft_tokens']:.0f}", flush=True)
    return raw


def summarize(raw: dict[str, list[dict]]) -> dict:
    out: dict = {"cases": {}}
    for key, rows in raw.items():
        tokens = sum(r["tokens"] for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        drafts = sum(r["num_drafts"] for r in rows)
        draft_tokens = sum(r["num_draft_tokens"] for r in rows)
        accepted = sum(r["num_accepted_tokens"] for r in rows)
        out["cases"][key] = {
            "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_round": [r["tokens"] / r["seconds"] for r in rows],
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "draft_tokens": draft_tokens, "accepted_tokens": accepted, "tokens": tokens, "seconds": seconds,
        }
    cases = out["cases"]
    for system in ("ngram", "draft"):
        for workload in ("copy", "free"):
            for batch in (1, 8):
                mine, off = cases.get(f"{system}_{workload}_b{batch}"), cases.get(f"off_{workload}_b{batch}")
                if mine and off:
                    # Per round, the two ran back to back: the median of those ratios follows the
                    # machine's load less than a ratio of totals would.
                    ratios = [a / b for a, b in zip(mine["tokens_per_s_per_round"], off["tokens_per_s_per_round"])]
                    out[f"spec_speedup_{system}_{workload}_b{batch}"] = statistics.median(ratios)
    return out


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = flags.parse(SpecSettings, argv, prog=prog, description=__doc__)
    require(MODEL, "run `make install` (it converts SmolLM2-135M-Instruct)")
    load = report.LoadWatch()
    with ExitStack() as stacks:
        systems = [System(name, stacks.enter_context(launched(settings.launch(name))), settings.tokens)
                   for name in settings.systems]
        raw = asyncio.run(measure(systems, settings.rounds, settings.workloads, settings.batches))
    load.stop()
    result = report.provenance(report.command_line(prog, argv), load) | summarize(raw)
    commit = result["git"]["short"] or "unknown"
    result.update(commit=commit, rounds=settings.rounds, max_tokens=settings.tokens, draft_layers=settings.draft_layers,
                  k=settings.num_speculative_tokens, model=str(MODEL.name), raw=raw)
    print(f"\n{'case':<18} {'tok/s':>7} {'accept':>7} {'mean len':>8}")
    for key, case in result["cases"].items():
        print(f"{key:<18} {case['tokens_per_s']:7.1f} {case['acceptance_rate']:7.2f} {case['mean_accepted_length']:8.2f}")
    for key in sorted(k for k in result if k.startswith("spec_speedup_")):
        print(f"{key} = {result[key]:.2f}")
    out = report.write_result(result, report.result_path("spec", settings.out or None, name=f"spec-{commit}"))
    print(f"wrote {out}")
    return 0
