"""Turn the systems' runs into the result: the ratios, the services-vs-in-process gap, goals, a summary line, a PNG.

The figures go beside harness.report's provenance (command, commit, machine, load) in one JSON file.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.records import SystemRun, throughput_timeline
from benchmarks.harness.step_codec import codec_ms_per_step

SYSTEM_KEYS = {
    "tokenmill services": "tokenmill_services",
    "tokenmill in-process": "tokenmill_inprocess",
    "HF sequential": "hf_sequential",
    "HF static batching": "hf_static",
}

GOALS = {"vs_hf_sequential": 8.0, "vs_hf_static": 1.5, "services_vs_inprocess": 0.9, "kv_waste": 0.04}


def _ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    if not numerator or not denominator:
        return None
    base = denominator["output_throughput_tps"]
    return numerator["output_throughput_tps"] / base if base > 0 else None


def _cpu_ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    if not numerator or not denominator:
        return None
    a, b = numerator.get("output_tokens_per_cpu_second"), denominator.get("output_tokens_per_cpu_second")
    return a / b if a and b else None


def output_match(runs: dict[str, SystemRun], reference: str = "tokenmill in-process") -> dict:
    """Per system: the fraction of requests whose greedy output ids equal the reference's.

    Random-weight models have near-tied logits, so float differences between batch shapes
    and attention kernels can flip a token and everything after it; a fraction below 1 is
    a note, not a failure of the timing comparison (the amount of work is forced equal).
    """
    if reference not in runs:
        return {}
    expected = {r.index: r.output_ids for r in runs[reference].records}
    out = {}
    for name, run in runs.items():
        if name == reference:
            continue
        pairs = [(r.output_ids, expected.get(r.index)) for r in run.records if r.ok]
        if pairs:
            out[SYSTEM_KEYS[name]] = sum(a == b for a, b in pairs) / len(pairs)
    return out


def services_gap(systems: dict[str, dict]) -> dict | None:
    """Where the services lose (or gain) against the in-process engine, per output token and per step."""
    services, inprocess = systems.get("tokenmill_services"), systems.get("tokenmill_inprocess")
    if not services or not inprocess:
        return None

    def ms_per_token(summary: dict) -> float:
        return 1000 * summary["duration_s"] / summary["output_tokens"] if summary["output_tokens"] else 0.0

    gap = {
        "throughput_ratio": _ratio(services, inprocess),
        "wall_ms_per_output_token": {"services": ms_per_token(services), "inprocess": ms_per_token(inprocess)},
        "services_steps": services.get("step_breakdown"),
        "inprocess_steps": inprocess.get("step_breakdown"),
    }
    s_steps, i_steps = services.get("step_breakdown"), inprocess.get("step_breakdown")
    if s_steps and i_steps:
        gap["codec_estimate_ms_per_step"] = codec_ms_per_step(s_steps["mean_batch_size"])
        tokens = services["output_tokens"]
        per_token = {}
        if "execute_ms_mean" in s_steps:
            per_token["compute (executor execute)"] = (
                s_steps["execute_ms_mean"] * s_steps["steps"] - i_steps["execute_ms_mean"] * i_steps["steps"]) / tokens
            per_token["executor round trip beyond compute (codec, gRPC, executor thread hop)"] = (
                s_steps["round_trip_overhead_ms_mean"] * s_steps["steps"]) / tokens
        per_token["scheduler python (schedule + update) vs engine python"] = (
            (s_steps["schedule_ms_mean"] + s_steps["update_ms_mean"]) * s_steps["steps"]
            - i_steps["engine_python_ms_mean"] * i_steps["steps"]) / tokens
        per_token["loop outside steps (publishing, detokenize, RPC handlers, idle) vs driver"] = (
            s_steps["loop_other_ms_mean"] * s_steps["steps"] - i_steps["driver_ms_mean"] * i_steps["steps"]) / tokens
        gap["extra_ms_per_output_token_by_cause"] = per_token
    return gap


def goals(result: dict) -> dict:
    def check(value, goal, higher_is_better=True):
        if value is None:
            return {"value": None, "goal": goal, "met": None}
        return {"value": value, "goal": goal, "met": value >= goal if higher_is_better else value <= goal}

    services = result["systems"].get("tokenmill_services") or result["systems"].get("tokenmill_inprocess") or {}
    waste = (services.get("kv_cache") or {}).get("mean_waste")
    return {
        "throughput_vs_hf_sequential": check(result["throughput_ratio_vs_hf_sequential"], GOALS["vs_hf_sequential"]),
        "throughput_vs_hf_static": check(result["throughput_ratio_vs_hf_static"], GOALS["vs_hf_static"]),
        "services_vs_inprocess": check(result["throughput_ratio_services_vs_inprocess"],
                                       GOALS["services_vs_inprocess"]),
        "kv_waste_mean": check(waste, GOALS["kv_waste"], higher_is_better=False),
    }


def build_result(runs: dict[str, SystemRun], summaries: dict[str, dict], meta: dict) -> dict:
    """The figures of ``summaries`` after ``meta`` (provenance and the run's settings)."""
    systems = {SYSTEM_KEYS[name]: summary for name, summary in summaries.items()}
    headline = systems.get("tokenmill_services") or systems.get("tokenmill_inprocess")
    result = {
        **meta,
        "ratio_basis": "tokenmill_services" if "tokenmill_services" in systems else "tokenmill_inprocess",
        "throughput_ratio_vs_hf_sequential": _ratio(headline, systems.get("hf_sequential")),
        "throughput_ratio_vs_hf_static": _ratio(headline, systems.get("hf_static")),
        "throughput_ratio_services_vs_inprocess": _ratio(systems.get("tokenmill_services"),
                                                         systems.get("tokenmill_inprocess")),
        "inprocess_ratio_vs_hf_sequential": _ratio(systems.get("tokenmill_inprocess"), systems.get("hf_sequential")),
        "inprocess_ratio_vs_hf_static": _ratio(systems.get("tokenmill_inprocess"), systems.get("hf_static")),
        # Output tokens per CPU second (all processes of the system): less sensitive than wall
        # time to whatever else the machine was running.
        "cpu_efficiency_ratios": {
            "vs_hf_sequential": _cpu_ratio(headline, systems.get("hf_sequential")),
            "vs_hf_static": _cpu_ratio(headline, systems.get("hf_static")),
            "services_vs_inprocess": _cpu_ratio(systems.get("tokenmill_services"), systems.get("tokenmill_inprocess")),
        },
        "systems": systems,
        "output_match_vs_inprocess": output_match(runs),
        "services_gap": services_gap(systems),
    }
    result["goals"] = goals(result)
    result["summary"] = summary_line(result)
    return result


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "x") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def summary_line(result: dict) -> str:
    basis = result["ratio_basis"]
    head = result["systems"][basis]
    seq_note = ""
    if result.get("hf_sequential_requests"):
        seq_note = f" (HF sequential on the first {result['hf_sequential_requests']} requests)"
    waste = (head.get("kv_cache") or {}).get("mean_waste")
    return (f"{basis}: {head['output_throughput_tps']:.1f} output tok/s = "
            f"{_fmt(result['throughput_ratio_vs_hf_sequential'])} HF sequential{seq_note}, "
            f"{_fmt(result['throughput_ratio_vs_hf_static'])} HF static; "
            f"services/in-process {_fmt(result['throughput_ratio_services_vs_inprocess'])}; "
            f"TTFT p99 {head['ttft_ms']['p99']:.0f} ms; "
            f"KV waste {_fmt(None if waste is None else 100 * waste, '.1f', '%')}")


def write_plot(runs: dict[str, SystemRun], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (("TTFT (ms)", lambda r: [x.ttft_s * 1000 for x in r.records if x.ok]),
              ("TPOT (ms)", lambda r: [t * 1000 for x in r.records if x.ok and (t := x.tpot_s) is not None]),
              ("end-to-end latency (s)", lambda r: [x.e2e_s for x in r.records if x.ok]))
    for ax, (label, values_of) in zip(axes.flat, panels):
        for name, run in runs.items():
            values = sorted(values_of(run))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
    ax = axes.flat[3]
    longest = max((run.end - run.start for run in runs.values()), default=1.0)
    bin_s = max(0.25, longest / 60)
    for name, run in runs.items():
        times, rates = throughput_timeline(run, bin_s)
        ax.plot(times, rates, label=name)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
