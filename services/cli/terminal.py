"""Print a Generate stream to the terminal (``tokenmill generate``, ``tokenmill up``'s demo)."""

from __future__ import annotations

import sys
import time

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.stack.client import TLSChoice, generate


def stream_to_terminal(address: str, request: generation_pb2.GenerateRequest, out=None,
                       timeout: float | None = 300.0, tls: TLSChoice = "env",
                       token: str | None = None) -> generation_pb2.Finished | None:
    """Print the deltas as they arrive; return the Finished message (and print TTFT, tokens/s).
    out: where the text goes (None: sys.stdout as it is at the call). tls: a ClientTLS, None
    (plaintext) or "env" (the TOKENMILL_TLS_* variables, if set). token: a bearer token."""
    out = sys.stdout if out is None else out
    start = time.perf_counter()
    finished = None
    for message in generate(address, request, timeout=timeout, tls=tls, token=token):
        kind = message.WhichOneof("event")
        if kind == "delta":
            out.write(message.delta.text)
            out.flush()
        elif kind == "finished":
            finished = message.finished
    out.write("\n")
    if finished is not None:
        n = finished.usage.completion_tokens
        decode_s = finished.timings.decode_time_ms / 1000.0
        tps = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
        reason = common_pb2.FinishReason.Name(finished.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(f"[{n} tokens, finish={reason}, TTFT {finished.timings.time_to_first_token_ms:.1f} ms, "
              f"{tps:.1f} tokens/s, wall {time.perf_counter() - start:.2f}s]", file=sys.stderr)
    return finished
