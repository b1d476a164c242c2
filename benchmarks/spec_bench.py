"""Speculative decoding through the four services on SmolLM2-135M-Instruct: off, n-gram, draft model.

    python -m benchmarks.spec_bench [--rounds 2] [--tokens 128] [--draft-layers 4]   (make bench-spec)
    tokenmill bench --preset spec [same flags]

Three stacks run side by side, started as `tokenmill up` starts them (the Launcher: four
processes, one OpenMP thread each; fp32 on a CPU): the scheduler without a drafter
(--num-speculative-tokens 0), with the n-gram drafter, and with the self-speculative draft
model (the target's first --draft-layers layers plus its final norm and head), both at up to
--k (8) drafts per step with adaptive k. Only one stack works at a time; the stacks take turns per
measurement, so load from other work on the machine falls on all three alike, and the
speedups are ratios within one run.

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

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.serving.services_run import free_port, scrape
from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.common.server import create_channel
from services.common.service_config import REPO_ROOT
from services.stack.client import build_request
from services.stack.launcher import LaunchConfig, Launcher

MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

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


class System:
    def __init__(self, name: str, tokens: int, draft_layers: int, k: int) -> None:
        self.name = name
        self.metrics_port = free_port()
        spec = [] if name == "off" else [f"--num-speculative-tokens={k}"]
        drafter = [f"--num-speculative-tokens={k}"] + (
            ["--method=draft_model", f"--draft-model={MODEL}", f"--draft-layers={draft_layers}"] if name == "draft" else [])
        self.launcher = Launcher(LaunchConfig(
            model=str(MODEL), public_port=0, log_dir=tempfile.mkdtemp(prefix=f"spec-bench-{name}-"),
            executor_args=[f"--kv-cache-bytes={512 * 1024**2}"], drafter_args=drafter,
            scheduler_args=spec + [f"--metrics-port={self.metrics_port}"],
            env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}, restart=False,
            start_timeout_s=900))  # three executors warming up at once on a busy machine
        self.tokens = tokens

    def counters(self) -> dict[str, float]:
        samples = scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")
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
    request = build_request(None, chat=chat, max_tokens=max_tokens, temperature=0.0)
    count = 0
    async for message in stub.Generate(request, timeout=900):
        if message.WhichOneof("event") == "delta":
            count += len(message.delta.token_ids)
    return count


async def measure(systems: list[System], rounds: int, workloads=("copy", "free"), batches=(1, 8)) -> dict:
    channels = [create_channel(s.launcher.public_address) for s in systems]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
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
    for channel in channels:
        await channel.close()
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


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="max output tokens per request")
    parser.add_argument("--draft-layers", type=int, default=4, help="layers of the self-speculative draft")
    parser.add_argument("--k", type=int, default=8, help="most drafts per sequence per step (scheduler and drafter)")
    parser.add_argument("--systems", default="off,ngram,draft")
    parser.add_argument("--workloads", default="copy,free")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--out", default="", help="result JSON (default benchmarks/results/spec-COMMIT.json)")
    args = parser.parse_args(argv)
    if not (MODEL / "config.json").is_file():
        raise SystemExit(f"{MODEL} is missing: run `make install` (it converts SmolLM2-135M-Instruct)")
    systems = [System(name, args.tokens, args.draft_layers, args.k) for name in args.systems.split(",")]
    try:
        for system in systems:
            system.launcher.start()
        raw = asyncio.run(measure(systems, args.rounds, args.workloads.split(","),
                                  [int(b) for b in args.batches.split(",")]))
    finally:
        for system in systems:
            system.launcher.stop()
    result = summarize(raw)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO_ROOT).stdout.strip() or "unknown"
    result.update(commit=commit, rounds=args.rounds, max_tokens=args.tokens, draft_layers=args.draft_layers, k=args.k,
                  model=str(MODEL.name), raw=raw)
    print(f"\n{'case':<18} {'tok/s':>7} {'accept':>7} {'mean len':>8}")
    for key, case in result["cases"].items():
        print(f"{key:<18} {case['tokens_per_s']:7.1f} {case['acceptance_rate']:7.2f} {case['mean_accepted_length']:8.2f}")
    for key in sorted(k for k in result if k.startswith("spec_speedup_")):
        print(f"{key} = {result[key]:.2f}")
    out = Path(args.out) if args.out else RESULTS_DIR / f"spec-{commit}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
