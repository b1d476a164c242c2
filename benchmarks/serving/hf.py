"""Systems (c) and (d): Hugging Face transformers generate(), the baselines.

(c) sequential: one request at a time, batch 1, in arrival order.
(d) static batching: batches of ``concurrency`` requests, left-padded to the longest
    prompt; each batch runs until its longest request has all its tokens
    (max_new_tokens = the batch's largest output length, no end token), so shorter
    requests ride along producing tokens nobody uses. Only each request's own output
    tokens count as useful.

Both are greedy with no EOS (the model loaded by harness.hf, eos_token_id=None): every row
runs its full length, the same work as tokenmill's max_tokens + ignore_eos. A streamer timestamps every decoding step, and
each request's tokens are credited at the step that produced them, as if streamed: this is
kind to the baselines (a static batch normally returns when the whole batch ends), so the
latency comparison errs in their favour.

KV waste: HF's dynamic cache holds a [batch, padded prompt + steps] tensor per layer. At
step s a row uses its own prompt + min(s, its output) slots; the rest (left padding, and
the tail after its last token) is allocated but unused. The figure reported is that
fraction averaged over the batch's steps, then over batches weighted by steps.
"""

from __future__ import annotations

import gc
import time
from collections import deque

import torch

from benchmarks.harness.records import RequestRecord, SystemRun
from benchmarks.serving.workload import BenchRequest

PAD_ID = 0


def _streamer():
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        """Records when each step's tokens exist; generate() first puts the prompt, skipped here."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value) -> None:
            if self._prompt_seen:
                self.times.append(time.perf_counter())
            self._prompt_seen = True

        def end(self) -> None:
            pass

    return StepClock()


def _generate(model, prompts: list[tuple[int, ...]], new_tokens: int):
    """Left-padded greedy generate of exactly ``new_tokens`` per row: (output ids [B, new_tokens], step times)."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)  # [B, width]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)   # [B, width]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID)
    clock = _streamer()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                             streamer=clock)
    return out[:, width:].tolist(), clock.times


def padding_waste(batch: list[BenchRequest]) -> tuple[float, int]:
    """Mean over the batch's steps of (allocated - used) / allocated KV slots, and the step count."""
    width = max(len(r.prompt_ids) for r in batch)
    steps = max(r.output_len for r in batch)
    total = 0.0
    for s in range(1, steps + 1):
        allocated = len(batch) * (width + s)
        used = sum(len(r.prompt_ids) + min(s, r.output_len) for r in batch)
        total += (allocated - used) / allocated
    return total / steps, steps


def _wait_for(arrival_s: float, start: float) -> None:
    delay = arrival_s - (time.perf_counter() - start)
    if delay > 0:
        time.sleep(delay)


def _warm_up(model) -> None:
    _generate(model, [(5, 6, 7, 8)], 2)


def run_hf_sequential(model, requests: list[BenchRequest], progress=None) -> SystemRun:
    _warm_up(model)
    gc.collect()
    records = []
    cpu_start = time.process_time()
    start = time.perf_counter()
    for request in sorted(requests, key=lambda r: r.arrival_s):
        _wait_for(request.arrival_s, start)
        record = RequestRecord(request.index, len(request.prompt_ids), request.output_len, time.perf_counter())
        (ids,), times = _generate(model, [request.prompt_ids], request.output_len)
        for when, token in zip(times, ids):
            record.add_chunk(when, [token])
        record.finish_time = times[-1]
        records.append(record)
        if progress is not None:
            progress.update(1)
    end = time.perf_counter()
    return SystemRun("HF sequential", sorted(records, key=lambda r: r.index), start, end,
                     extra={"kv_padding_waste_mean": 0.0, "cpu_seconds": time.process_time() - cpu_start})


def run_hf_static(model, requests: list[BenchRequest], batch_size: int, progress=None) -> SystemRun:
    _warm_up(model)
    gc.collect()
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    records = []
    waste_weighted = 0.0
    waste_steps = 0
    useful_tokens = computed_tokens = 0
    cpu_start = time.process_time()
    start = time.perf_counter()
    while pending:
        _wait_for(pending[0].arrival_s, start)
        elapsed = time.perf_counter() - start
        batch = []
        while pending and len(batch) < batch_size and pending[0].arrival_s <= elapsed:
            batch.append(pending.popleft())
        sent = time.perf_counter()
        new_tokens = max(r.output_len for r in batch)
        outputs, times = _generate(model, [r.prompt_ids for r in batch], new_tokens)
        for request, ids in zip(batch, outputs):
            record = RequestRecord(request.index, len(request.prompt_ids), request.output_len, sent)
            for when, token in zip(times[:request.output_len], ids[:request.output_len]):
                record.add_chunk(when, [token])
            record.finish_time = times[request.output_len - 1]
            records.append(record)
        waste, steps = padding_waste(batch)
        waste_weighted += waste * steps
        waste_steps += steps
        useful_tokens += sum(r.output_len for r in batch)
        computed_tokens += len(batch) * new_tokens
        if progress is not None:
            progress.update(len(batch))
    end = time.perf_counter()
    extra = {
        "cpu_seconds": time.process_time() - cpu_start,
        "kv_padding_waste_mean": waste_weighted / waste_steps if waste_steps else 0.0,
        "useful_output_token_fraction": useful_tokens / computed_tokens if computed_tokens else 0.0,
    }
    return SystemRun("HF static batching", sorted(records, key=lambda r: r.index), start, end, extra=extra)
