"""The benchmark workload: which requests, how long, when they arrive.

Every system runs the same list of BenchRequest: the same prompt token ids and the same
output length, forced by max_tokens + ignore_eos (greedy), so throughput compares equal work.
Prompts are random token ids (seeded) unless a JSONL file gives them; a shared-prefix
fraction makes every prompt start with the same tokens, which the prefix cache can reuse.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

FIRST_ORDINARY_ID = 3
"""Ids 0..2 are <unk>, <s>, </s> in every model the benchmark ships with; random prompts avoid them."""


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token count: fixed (low == high) or uniform over [low, high], both ends included."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, what: str) -> LengthDist:
        """'128' (fixed) or '32:256' (uniform [32, 256])."""
        try:
            low, _, high = text.partition(":")
            dist = cls(int(low), int(high or low))
        except ValueError:
            raise ValueError(f"{what} must be N or LOW:HIGH, got {text!r}") from None
        if dist.low < 1 or dist.high < dist.low:
            raise ValueError(f"{what} {text!r}: need 1 <= LOW <= HIGH")
        return dist

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"uniform[{self.low},{self.high}]"


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_requests: int
    prompt_len: LengthDist
    output_len: LengthDist
    concurrency: int = 8
    """Requests in flight at once (closed loop), and the HF static batch size. With a request
    rate it caps the requests in flight instead."""
    request_rate: float | None = None
    """Poisson arrivals at this many requests/s; None = all available at once (closed loop)."""
    shared_prefix_fraction: float = 0.0
    """Share of each prompt (leading tokens) identical across all prompts."""
    prompts_file: str | None = None
    """JSONL: {"prompt": text} or {"prompt_ids": [...]}, optional "output_len"; used in order, cycled."""
    seed: int = 0

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError(f"shared_prefix_fraction must be in [0, 1], got {self.shared_prefix_fraction}")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    index: int
    prompt_ids: tuple[int, ...]
    output_len: int
    arrival_s: float
    """Offset from the start of the run when the request may be sent (0 in closed loop)."""


def _prompts_from_file(path: str, tokenizer) -> list[tuple[list[int], int | None]]:
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if "prompt_ids" in item:
            ids = [int(i) for i in item["prompt_ids"]]
        elif "prompt" in item:
            if tokenizer is None:
                raise ValueError(f"{path}:{number}: a text prompt needs the model's tokenizer")
            ids = tokenizer.encode(item["prompt"])
        else:
            raise ValueError(f"{path}:{number}: each line needs 'prompt' or 'prompt_ids'")
        if not ids:
            raise ValueError(f"{path}:{number}: empty prompt")
        rows.append((ids, int(item["output_len"]) if "output_len" in item else None))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def build_workload(spec: WorkloadSpec, vocab_size: int, max_model_len: int, tokenizer=None) -> list[BenchRequest]:
    """The seeded request list. Raises ValueError when a request cannot fit the model's context."""
    spec.validate()
    rng = random.Random(spec.seed)
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary token ids")
    file_rows = _prompts_from_file(spec.prompts_file, tokenizer) if spec.prompts_file else None
    prefix = [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(max(spec.prompt_len.high, 1))]
    requests: list[BenchRequest] = []
    arrival = 0.0
    for index in range(spec.num_requests):
        output_len = spec.output_len.sample(rng)
        if file_rows is not None:
            prompt, file_output_len = file_rows[index % len(file_rows)]
            output_len = file_output_len or output_len
        else:
            length = spec.prompt_len.sample(rng)
            shared = min(length - 1, round(spec.shared_prefix_fraction * length))
            prompt = prefix[:shared] + [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(length - shared)]
        if len(prompt) + output_len >= max_model_len:
            raise ValueError(f"request {index}: prompt {len(prompt)} + output {output_len} tokens does not fit "
                             f"max_model_len {max_model_len}")
        if spec.request_rate is not None and index > 0:
            arrival += rng.expovariate(spec.request_rate)
        requests.append(BenchRequest(index, tuple(prompt), output_len, arrival))
    return requests
