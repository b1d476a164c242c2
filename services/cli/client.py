"""A small client of the public Generation API, used by the CLI (generate, up's demo)."""

from __future__ import annotations

import sys
import time

import grpc

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def build_request(prompt: str | list[int] | None, *, max_tokens: int = 128, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                  ignore_eos: bool = False, stop: list[str] | tuple[str, ...] = (),
                  bos_token_id: int | None = None) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest()
    if isinstance(prompt, list):
        req.token_ids.ids.extend(prompt)
    elif prompt:
        req.text = prompt
    elif bos_token_id is not None:
        req.token_ids.ids.append(bos_token_id)  # no prompt: start from BOS alone
    req.sampling.temperature = temperature
    req.sampling.top_k = top_k
    req.sampling.top_p = top_p
    req.sampling.min_p = min_p
    if seed is not None:
        req.sampling.seed = seed
    req.stop.max_tokens = max_tokens
    req.stop.ignore_eos = ignore_eos
    req.stop.stop.extend(stop)
    return req


def stream_to_terminal(address: str, request: generation_pb2.GenerateRequest, out=sys.stdout,
                       timeout: float | None = 300.0) -> generation_pb2.Finished | None:
    """Print the deltas as they arrive; return the Finished message (and print TTFT, tokens/s)."""
    start = time.perf_counter()
    first = None
    finished = None
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for message in stub.Generate(request, timeout=timeout):
            kind = message.WhichOneof("event")
            if kind == "delta":
                if first is None and message.delta.token_ids:
                    first = time.perf_counter()
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


def model_info(address: str, timeout: float = 10.0) -> generation_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                                       timeout=timeout)


def stream_generate(args) -> int:
    try:
        bos = None
        if not args.prompt:
            info = model_info(args.address)
            bos = info.bos_token_id if info.HasField("bos_token_id") else None
        request = build_request(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                                ignore_eos=args.ignore_eos, stop=args.stop, bos_token_id=bos)
        sys.stdout.write(args.prompt)
        stream_to_terminal(args.address, request)
    except grpc.RpcError as exc:
        print(f"\ntokenmill generate: {exc.code().name}: {exc.details()} (address {args.address})", file=sys.stderr)
        return 1
    return 0
