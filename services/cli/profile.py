"""``tokenmill profile``: print the live latency profile of a running stack (GetProfile)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from services.common.pb.tokenmill.v1 import generation_pb2
from services.stack.client import default_address, fetch_profile


def profile_dict(profile: generation_pb2.LatencyProfile) -> dict:
    """Every field, zeros included, under its proto name."""
    return MessageToDict(profile, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def format_profile(p: generation_pb2.LatencyProfile) -> str:
    return "\n".join([
        f"window            {p.window_seconds:.0f} s, {p.num_requests} requests finished",
        f"TTFT              p50 {p.ttft_p50_ms:9.1f} ms   p99 {p.ttft_p99_ms:9.1f} ms",
        f"TPOT              p50 {p.tpot_p50_ms:9.1f} ms   p99 {p.tpot_p99_ms:9.1f} ms",
        f"tokens/s          {p.tokens_per_second_total:9.1f} total   "
        f"{p.tokens_per_second_per_stream:9.1f} per stream (median)",
        f"max output        {p.max_output_tokens} tokens",
        f"now               {p.num_running} running, {p.num_waiting} waiting, "
        f"KV cache {100 * p.kv_cache_usage:.1f}% used",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill profile", description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=default_address(),
                        help="public API address of a running stack (env TOKENMILL_ADDRESS; default 127.0.0.1 on "
                             "TOKENMILL_SCHEDULER_PORT, else 50051: %(default)s)")
    parser.add_argument("--token", default=os.environ.get("TOKENMILL_TOKEN", ""),
                        help="bearer token for a stack with tenants (env TOKENMILL_TOKEN)")
    parser.add_argument("--window", type=float, default=None,
                        help="look back this many seconds (default: the server's configured window)")
    parser.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    args = parser.parse_args(argv)
    try:
        profile = fetch_profile(args.address, args.window, token=args.token or None)
    except grpc.RpcError as exc:
        print(f"tokenmill profile: {exc.code().name}: {exc.details()} (address {args.address})", file=sys.stderr)
        return 1
    print(json.dumps(profile_dict(profile), sort_keys=True) if args.json else format_profile(profile))
    return 0
