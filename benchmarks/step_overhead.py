"""Where a services step's wall time goes: CPU per step of each process, against the in-process engine.

``python -m benchmarks.step_overhead [--streams 1] [--output-len 256] [--rounds 3]``

Starts the four services (one torch thread each, the peer benchmark's engine options) and an
in-process engine in this process, then alternates timed runs of the two (so machine load
hits both alike) and prints, per round, tokens/s of each, their ratio, and the CPU time each
service process (utime + stime from /proc/<pid>/stat) and this client spent per decode step.
On a 2-core machine the processes share the cores, so CPU per step adds up against the wall.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks.peer.driver import DEFAULT_MODEL
from benchmarks.peer.tokenmill import InProcess, Services, services_stack
from benchmarks.serving.cpu_time import process_cpu_seconds
from benchmarks.serving.services_run import scrape

PROMPT = [1, 403, 407, 261, 378]
"""BOS + "Once upon a time" in stories260K's tokenizer (any short prompt does)."""


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    seconds = process_cpu_seconds(pid)
    if seconds is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return seconds


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed) of a process."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        name = head.split("(", 1)[1]
        fields = rest.split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    inproc = InProcess(args.model)
    rows = []
    with services_stack(args.model, threads=1) as stack:
        services = Services(stack.address)
        services.run(PROMPT, args.streams, 8)  # warm
        pids = dict(stack.pids, client=os.getpid())
        for round_ in range(args.rounds):
            own = cpu_seconds(os.getpid())
            run_in, out_in = inproc.run(PROMPT, args.streams, args.output_len)
            inproc_cpu = cpu_seconds(os.getpid()) - own
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            counters = scrape(stack.scheduler_metrics)
            threads_before = {name: thread_cpu_seconds(pids[name]) for name in ("executor", "scheduler")}
            run_sv, out_sv = services.run(PROMPT, args.streams, args.output_len)
            cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
            moved = {k: v - counters.get(k, 0.0) for k, v in scrape(stack.scheduler_metrics).items()
                     if k.endswith(("scheduler_steps_total", "scheduler_detokenize_rounds_total"))}
            threads = {}
            for name, was in threads_before.items():
                now = thread_cpu_seconds(pids[name])
                threads[name] = {t: round(1e3 * (v - was.get(t, 0.0)) / args.output_len, 3) for t, v in now.items()
                                 if v - was.get(t, 0.0) > 0}
            steps = args.output_len  # one decode step per token per stream (batched streams share it)
            row = {"inprocess_tok_s": run_in.tokens_per_s, "services_tok_s": run_sv.tokens_per_s,
                   "services_ms_per_step": 1e3 * run_sv.seconds / steps,
                   "inprocess_ms_per_step": 1e3 * run_in.seconds / steps,
                   "cpu_ms_per_step": {k: round(1e3 * v / steps, 3) for k, v in cpu.items()},
                   "inprocess_cpu_ms_per_step": round(1e3 * inproc_cpu / steps, 3),
                   "thread_cpu_ms_per_step": threads,
                   "scheduler_counters": moved,
                   "identical": out_in == out_sv}
            row["ratio"] = row["services_tok_s"] / row["inprocess_tok_s"]
            rows.append(row)
            print(f"round {round_}: in-process {row['inprocess_tok_s']:.0f} tok/s, services {row['services_tok_s']:.0f} "
                  f"tok/s, ratio {row['ratio']:.2f}; in-process CPU {row['inprocess_cpu_ms_per_step']:.2f} ms/step; services {row['services_ms_per_step']:.2f} ms/step, CPU ms/step "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_ms_per_step"].items())
                  + f"; outputs identical {row['identical']}; scheduler counters {moved}; per thread {threads}", flush=True)
    print(f"median ratio services/in-process: {statistics.median(r['ratio'] for r in rows):.2f} "
          f"({args.streams} stream(s), {args.output_len} tokens, load {os.getloadavg()[0]:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rows, "loadavg": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
