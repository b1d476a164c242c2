"""llama.cpp's systems for the comparison, through llama-cpp-python (``pip install llama-cpp-python``).

Three ways to run the same GGUF, each greedy (llama.cpp's greedy sampler: temperature 0),
never stopping at EOS, ``threads`` threads for prompt and generation alike:

- ``LlamaGenerate``: llama-cpp-python's high-level API, ``Llama.generate(temp=0)``: what a
  Python user of llama.cpp writes. One stream; it has no batching across requests.
- ``DecodeLoop`` (one stream): llama.cpp's C API in a tight loop, as its ``simple`` example
  does: ``llama_decode`` of one token, ``llama_sampler_sample`` with the greedy sampler. The
  least Python per token there can be; the single-stream baseline.
- ``DecodeLoop`` with ``max_streams`` > 1, "llama.cpp batched": several sequences in one
  context (``n_seq_max``), one ``llama_decode`` per step carrying one token of every
  sequence, as llama.cpp's ``batched`` example and llama-server's parallel slots do:
  llama.cpp's own batched decoding, all sequences starting together (no request arrives
  mid-run, so nothing needs continuous batching). Each sequence has its own K/V stream
  (``kv_unified`` off: attention reads only its own tokens; a unified cache was slower here).

Importing this module needs llama_cpp; the driver imports it only when it runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import llama_cpp

from benchmarks.harness.timed_run import Run

KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}
FLASH_ATTN = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
"""Flash attention off, as Llama() has it by default. Its CPU kernel is the slower one for this
model (head_dim 8): with "auto" (the C API's default, which turns it on here) the decode loop
ran ~3,000 tok/s against ~5,500 without, one thread, and 32 batched sequences likewise."""


def load(gguf: Path, threads: int, n_ctx: int) -> llama_cpp.Llama:
    """The high-level model object; its model pointer also serves the C-API contexts below."""
    return llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads,
                           flash_attn=False, seed=0, verbose=False)


def tokenize(llm: llama_cpp.Llama, text: str) -> list[int]:
    """llama.cpp's own tokenization of ``text`` with BOS, to compare with tokenmill's."""
    return llm.tokenize(text.encode(), add_bos=True)


def detokenize(llm: llama_cpp.Llama, tokens: Sequence[int]) -> str:
    return llm.detokenize(list(tokens)).decode(errors="replace")


class LlamaGenerate:
    name = "llama-cpp-python generate"

    def __init__(self, llm: llama_cpp.Llama) -> None:
        self.llm = llm

    def run(self, prompt: Sequence[int], streams: int, output_len: int) -> tuple[Run, list[list[int]]]:
        assert streams == 1, "Llama.generate runs one stream"
        tokens: list[int] = []
        self.llm.reset()  # no reuse of the previous run's K/V
        start = time.perf_counter()
        for token in self.llm.generate(list(prompt), temp=0.0, top_k=1, reset=True):
            tokens.append(token)
            if len(tokens) == output_len:
                break
        seconds = time.perf_counter() - start
        return Run(1, len(tokens), seconds), [tokens]


class _Context:
    """A llama_context on a loaded model, a llama_batch sized for it and a greedy sampler."""

    def __init__(self, model, threads: int, n_seq: int, n_ctx_per_seq: int, kv_type: str) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_seq * n_ctx_per_seq
        params.n_batch = max(n_seq * n_ctx_per_seq, 512)
        # llama.cpp reserves compute memory for a whole micro-batch of logits: n_ubatch x vocabulary
        # floats (32 x 1024 x 49,152 would be 6 GiB for SmolLM2); decode batches here are far smaller.
        params.n_ubatch = 512
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False  # one K/V stream per sequence: n_ctx_per_seq cells each
        params.type_k = params.type_v = KV_TYPES[kv_type]
        params.flash_attn_type = FLASH_ATTN
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self.sampler = llama_cpp.llama_sampler_init_greedy()

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)

    def decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        code = llama_cpp.llama_decode(self.ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def sample(self, batch_index: int) -> int:
        """Greedy token from the logits of the last decode's entry ``batch_index`` (which asked for them)."""
        return llama_cpp.llama_sampler_sample(self.sampler, self.ctx, batch_index)

    def close(self) -> None:
        llama_cpp.llama_sampler_free(self.sampler)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


def _generate(context: _Context, prompt: Sequence[int], streams: int, output_len: int) -> list[list[int]]:
    """Every sequence gets the prompt in one decode (logits at its last token), then one token
    per sequence per decode until each has ``output_len``."""
    context.clear()
    n = len(prompt)
    context.decode([(token, pos, seq, pos == n - 1) for seq in range(streams) for pos, token in enumerate(prompt)])
    outputs: list[list[int]] = [[] for _ in range(streams)]
    last = [seq * n + n - 1 for seq in range(streams)]  # batch index of each sequence's last token
    for step in range(output_len):
        for seq in range(streams):
            outputs[seq].append(context.sample(last[seq]))
        if step + 1 == output_len:
            break
        context.decode([(outputs[seq][-1], n + step, seq, True) for seq in range(streams)])
        last = range(streams)
    return outputs


class DecodeLoop:
    """DecodeLoop(..., max_streams=1): the single-stream loop; more: llama.cpp batched decoding."""

    def __init__(self, llm: llama_cpp.Llama, threads: int, n_ctx: int, kv_type: str, max_streams: int = 1) -> None:
        self.name = "llama.cpp decode loop" if max_streams == 1 else "llama.cpp batched"
        self.max_streams = max_streams
        # The context points into the Llama object's model: holding the object keeps the model
        # alive (freed, a later decode reads freed memory and the process dies of SIGSEGV).
        self.llm = llm
        self.context = _Context(llm.model, threads, max_streams, n_ctx, kv_type)

    def run(self, prompt: Sequence[int], streams: int, output_len: int) -> tuple[Run, list[list[int]]]:
        assert streams <= self.max_streams, f"context built for {self.max_streams} sequences"
        start = time.perf_counter()
        outputs = _generate(self.context, prompt, streams, output_len)
        seconds = time.perf_counter() - start
        return Run(streams, streams * output_len, seconds), outputs

    def close(self) -> None:
        self.context.close()


def version() -> str:
    return getattr(llama_cpp, "__version__", "?")


def system_info() -> str:
    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()

