"""``python -m benchmarks NAME [FLAGS]``: every benchmark run, by name.

Each run is a module with ``main(argv, prog) -> int`` whose flags come from its settings
dataclass (benchmarks/harness/flags.py). The module is imported only when its run is asked
for: a run never pays for another's imports (torch, transformers, llama.cpp).
"""

from __future__ import annotations

import importlib
import sys

from benchmarks.harness.report import PROG

RUNS: dict[str, tuple[str, str]] = {
    "serving": ("benchmarks.serving.driver",
                "services, in-process and Hugging Face on one workload (make bench, bench-quick)"),
    "peer": ("benchmarks.peer.driver", "tokenmill against llama.cpp on the same model (make bench-peer)"),
    "peer-quality": ("benchmarks.peer.quality",
                     "SmolLM2's GGUF: perplexity and greedy answers, exact vs int8 activations vs llama.cpp"),
    "spec": ("benchmarks.spec",
             "speculative decoding off / n-gram / draft model through the services (make bench-spec)"),
    "kquants": ("benchmarks.kquants", "SmolLM2 re-quantized to a Q4_K_M-like K-quant mix: kept blocks against fp32"),
    "weights": ("benchmarks.weights", "SmolLM2-135M in fp32, bf16, int8 and int4 side by side (make bench-smollm2)"),
    "decode": ("benchmarks.decode", "in-process decode throughput against HF generate() (make bench-decode)"),
    "draft-model": ("benchmarks.draft_model", "what a draft-model proposal costs, and how often it is right"),
    "stress": ("benchmarks.stress", "hundreds of streams under abuse, then a check that nothing leaked (make stress)"),
    "fairness": ("benchmarks.fairness", "two tenants, one flooding: does the quiet one's TTFT hold"),
    "overload": ("benchmarks.overload", "how fast a full server says no (RESOURCE_EXHAUSTED under a burst)"),
    "hostile-flood": ("benchmarks.hostile_flood",
                      "one tenant sends hostile requests: do the other's streams complete, its TTFT beside alone"),
    "gateway": ("benchmarks.gateway.driver",
                "the gateway: HTTP overhead, routing policies, decision time, routed requests/s (make bench-gateway)"),
    "gateway-mixed": ("benchmarks.gateway.mixed_pool",
                      "two tokenmill engines and a llama.cpp server behind one latency route: llama.cpp gets "
                      "requests only while its passive profile meets their SLA"),
    "executors": ("benchmarks.executors", "two executors against one, prefill/decode split, failover (make bench-executors)"),
    "tensor-parallel": ("benchmarks.tensor_parallel",
                        "decode steps of a model over tensor-parallel ranks against one rank on one and two threads"),
    "structured": ("benchmarks.structured",
                   "decode tok/s under a JSON schema against unconstrained; first token, new schema against cached"),
    "lora-serving": ("benchmarks.lora_serving",
                     "8 LoRA adapters mixed over 32 streams against the base, one adapter's stream, an adapter "
                     "loaded while streams run (make bench-lora)"),
    "moe": ("benchmarks.moe", "a random Q4_K mixture-of-experts GGUF against llama.cpp on the same file and against "
                              "a dense model of its active parameters (make bench-moe)"),
    "gpu": ("benchmarks.gpu_check", "one-shot check of the Triton kernels and the stack on a GPU"),
}
"""The runs: name -> (module, what it measures)."""

MICRO: dict[str, tuple[str, str]] = {
    "step-codec": ("benchmarks.micro.step_codec", "a decode step through the codec and the wire format"),
    "sampler": ("benchmarks.micro.sampler", "the sampler's batch build and sampling, greedy against mixed"),
    "fused-step": ("benchmarks.micro.fused_step", "the fused CPU step against the eager forward, by step size"),
    "cpu-paged-decode": ("benchmarks.micro.cpu_paged_decode", "the C++ paged decode kernel against another revision's"),
    "quant-products": ("benchmarks.micro.quant_products",
                       "the quantized CPU products per instruction set, int8 activations against exact"),
    "kquant-products": ("benchmarks.micro.kquant_products",
                        "a Q4_K_M file's K-quant and q5_0 products per instruction set against fp32"),
    "kv-quant-cpu": ("benchmarks.micro.kv_quant_cpu", "the C++ kernels over an int8/fp8 KV pool against fp32"),
    "overlap": ("benchmarks.micro.overlap", "per-step time through the services, overlapped scheduling on and off"),
    "grammar-masks": ("benchmarks.micro.grammar_masks", "token-mask cost of llguidance against xgrammar (structured outputs)"),
    "lora-products": ("benchmarks.micro.lora_products",
                      "SmolLM2's products with 8 LoRA adapters mixed in a step against the base alone"),
    "step-overhead": ("benchmarks.micro.step_overhead", "CPU per step of each service process against in-process"),
    "expert-parallel": ("benchmarks.micro.expert_parallel",
                        "sparse layers' experts over tensor-parallel ranks against one rank: all-to-all against compute"),
}
"""Micro-benchmarks (benchmarks/micro/): each answered one question; docs/benchmarks.md has the answer."""

ENTRIES = RUNS | MICRO


def usage() -> str:
    lines = [f"usage: {PROG} NAME [FLAGS]   ({PROG} NAME --help: its flags)", "", "runs:"]
    lines += [f"  {name:<17} {what}" for name, (_, what) in RUNS.items()]
    lines += ["", "micro-benchmarks (one question each):"]
    lines += [f"  {name:<17} {what}" for name, (_, what) in MICRO.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in ENTRIES:
        print(f"{PROG}: unknown run {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(ENTRIES[name][0])
    return int(module.main(rest, prog=f"{PROG} {name}") or 0)


if __name__ == "__main__":
    raise SystemExit(main())
