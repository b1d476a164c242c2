"""The gateway's routes file (YAML or JSON): the targets, and for each model id how to route it.

    targets:
      - name: fast                     # unique; metrics and logs use it
        address: 10.0.0.5:50051        # a tokenmill engine's public Generation API
        model: SmolLM2-135M-Instruct   # what the engine serves (informational)
        cost: 1.0                      # relative price of a token there (default 1)
        tags: [gpu]
        tls: {ca: ca.pem, cert: client.pem, key: client.key}   # optional: TLS / mTLS to it
        token_env: FAST_TOKEN          # optional: bearer token (from this variable) for the
                                       # gateway's own GetProfile calls when the engine has tenants
        requests_per_minute: 600       # optional: the target's budgets (rate_limits.py); a target
        tokens_per_minute: 500000      # at one is passed over for the route's next, and with all
                                       # of them at theirs the request is 429 with retry-after
      - {name: weak, address: 10.0.0.6:50051, cost: 0.2}
      - name: llamacpp                 # an OpenAI-compatible server (vLLM, llama.cpp, SGLang, ...)
        kind: openai                   # tokenmill (default) | openai | anthropic
        url: http://10.0.0.7:8080/v1   # its base URL: chat/completions, completions, models below it
        model: smollm2                 # the model id sent upstream (required for openai/anthropic)
        token_env: LLAMACPP_KEY        # optional: its API key, read from this variable
        tls: {ca: ca.pem, verify: true}  # optional: https with this CA (verify false: no check)
        timeouts: {connect_s: 2, ttft_s: 5, total_s: 120}   # optional, any kind; 0 = none
        seed_profile: {ttft_p50_ms: 300, ttft_p99_ms: 900, tokens_per_second: 40}
                                       # optional: what routing assumes before it has measured
        breaker: {failures: 5, open_s: 10}   # optional, any kind: out after 5 failed requests in
                                       # a row, one probe request 10 s later (these defaults)
        max_concurrency: 1             # optional: requests it runs at once; while the gateway has
                                       # that many there, the route's other targets go first
        tokenizer: models/smollm2      # optional (openai/anthropic): a model directory or
                                       # tokenizer.json, to count the usage an upstream reports not
    models:
      chat:                            # the model id clients ask for
        route: {strategy: latency, targets: [fast, weak]}
        sla_ms: 2000                   # default SLA when the request names none (absent: none)
        sla_percentile: 50             # 50 = judge on medians, 99 = on p99s (the worst case)
        expected_output_tokens: 256    # when the request sets no max_tokens
        tokenizer: models/smollm2      # optional: a model directory or tokenizer.json, to name
                                       # tokens in logprobs and echo token-id prompts
        tool_call_parser: hermes       # optional: how tool_choice auto reads calls out of replies
                                       # (auto, none, hermes, llama3_json, mistral; absent: the
                                       # gateway's --tool-call-parser)
        reasoning_parser: qwen3        # optional: <think> sections to reasoning_content (none,
                                       # deepseek_r1, qwen3; absent: the gateway's --reasoning-parser)
      small: weak                      # a bare target name routes everything there
    default_model: chat                # for gRPC clients that name no model (default: the first)

Upstreams of kind ``openai`` and ``anthropic`` are reached over HTTP (services/gateway/upstreams);
their credentials come only from the environment (``token_env``). They have no GetProfile: the
gateway measures their profile from the streams it relays (routing/passive_profile.py), starting
from ``seed_profile`` when given.

A route is a target name or a strategy node ``{strategy, targets, ...}``; nodes nest (see
routing/build.py for each strategy's options). Loading checks everything and raises
ValueError naming the file and the path of the bad entry.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.gateway.rate_limits import FIELDS as LIMIT_FIELDS, RateLimits, parse_limits
from services.gateway.reasoning import PARSER_SETTINGS as REASONING_PARSER_SETTINGS
from services.gateway.tool_calls import PARSER_SETTINGS

DEFAULT_EXPECTED_OUTPUT_TOKENS = 256
KINDS = ("tokenmill", "openai", "anthropic")
"""What a target is: a tokenmill engine (gRPC), an OpenAI-compatible or an Anthropic Messages
HTTP endpoint."""


@dataclass(frozen=True, slots=True)
class TargetTLS:
    ca: str = ""
    cert: str = ""
    key: str = ""
    verify: bool = True
    """HTTP upstreams: check the server's certificate (against ``ca``, else the system's CAs)."""


@dataclass(frozen=True, slots=True)
class TargetTimeouts:
    """Per-request limits on one target, seconds; 0 = none (the gateway's --request-timeout-s
    still bounds the whole request)."""

    connect_s: float = 0.0
    """HTTP upstreams: to open the connection."""
    ttft_s: float = 0.0
    """From sending the request to its first token: past it the request ends DEADLINE_EXCEEDED
    (a fallback route moves it to its next target)."""
    total_s: float = 0.0
    """The whole request on this target."""


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """The target's circuit breaker (routing/breaker.py)."""

    failures: int = 5
    """Failed requests in a row (the target's failures, not the requests') that take it out."""
    open_s: float = 10.0
    """How long it stays out before one request probes it."""


@dataclass(frozen=True, slots=True)
class SeedProfile:
    """A target's latency until the gateway has measured it (the shape of a model's published
    latency: TTFT median and p99, decode speed of one stream)."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_second: float


@dataclass(frozen=True, slots=True)
class TargetSpec:
    name: str
    address: str
    model: str = ""
    cost: float = 1.0
    tags: tuple[str, ...] = ()
    tls: TargetTLS | None = None
    token: str = ""
    """tokenmill: bearer token the gateway presents on its own calls (GetProfile, GetModelInfo);
    clients' calls carry the client's own Authorization. openai/anthropic: the API key of every
    call (clients' own keys are never forwarded to an HTTP upstream)."""
    limits: RateLimits = RateLimits()
    """Its requests and tokens per minute (rate_limits.py); none by default."""
    kind: str = "tokenmill"
    timeouts: TargetTimeouts = TargetTimeouts()
    seed: SeedProfile | None = None
    breaker: BreakerSettings = BreakerSettings()
    max_concurrency: int = 0
    """Requests the target runs at once (a llama.cpp server's slots; 1 for llama-cpp-python's
    server); while the gateway has that many open there, the route tries its other targets
    first. 0: no bound (an engine or vLLM batches whatever comes)."""
    tokenizer: str = ""
    """openai/anthropic: the served model's tokenizer (a model directory or tokenizer.json), to
    count the usage an upstream does not report; without it that usage is estimated."""
    stream_tools: bool = True
    """openai: false asks for a whole reply (``stream: false``) when a chat request offers tools
    with tool_choice auto, relayed as one piece: for a server that makes such calls only
    unstreamed (llama-cpp-python's ``chatml-function-calling`` format). That reply's first token
    then waits for its last."""

    @property
    def http(self) -> bool:
        return self.kind != "tokenmill"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    route: Any
    """The route node as written (checked and built by routing/build.py)."""
    sla_ms: float | None = None
    sla_percentile: int = 50
    expected_output_tokens: int = DEFAULT_EXPECTED_OUTPUT_TOKENS
    tokenizer: str = ""
    tool_call_parser: str = ""
    """How ``tool_choice: auto`` reads calls out of replies (services/gateway/tool_calls); "" =
    the gateway's ``--tool-call-parser``."""
    reasoning_parser: str = ""
    """How chat replies' reasoning is read out (services/gateway/reasoning); "" = the gateway's
    ``--reasoning-parser``."""


@dataclass(frozen=True, slots=True)
class RoutesFile:
    targets: tuple[TargetSpec, ...]
    models: dict[str, ModelSpec]
    default_model: str


def _check_keys(item: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown} (allowed: {sorted(allowed)})")


def _target(item: Any, where: str, base: Path) -> TargetSpec:
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object with name and address")
    kind = item.get("kind", "tokenmill")
    if kind not in KINDS:
        raise ValueError(f"{where}.kind must be one of {list(KINDS)}, got {kind!r}")
    common = {"name", "kind", "model", "cost", "tags", "tls", "token_env", "timeouts", "seed_profile", "breaker",
              "max_concurrency", *LIMIT_FIELDS}
    _check_keys(item, common | ({"address"} if kind == "tokenmill" else {"url", "tokenizer"})
                | ({"stream_tools"} if kind == "openai" else set()), where)
    if not isinstance(item.get("stream_tools", True), bool):
        raise ValueError(f"{where}.stream_tools must be true or false, got {item['stream_tools']!r}")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name must be a non-empty string")
    if kind == "tokenmill":
        address = item.get("address")
        if not isinstance(address, str) or ":" not in address:
            raise ValueError(f"{where}.address must be host:port, got {address!r}")
    else:
        address = item.get("url")
        if not isinstance(address, str) or not address.startswith(("http://", "https://")):
            raise ValueError(f"{where}.url must be an http:// or https:// base URL (e.g. http://host:8080/v1), "
                             f"got {address!r}")
        address = address.rstrip("/")
        if not isinstance(item.get("model"), str) or not item["model"]:
            raise ValueError(f"{where}.model must name the model to ask the {kind} upstream for")
    cost = item.get("cost", 1.0)
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or cost < 0:
        raise ValueError(f"{where}.cost must be a number >= 0, got {cost!r}")
    tags = item.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"{where}.tags must be a list of strings")
    token = ""
    if (env := item.get("token_env")) is not None:
        if not isinstance(env, str) or env not in os.environ:
            raise ValueError(f"{where}.token_env: environment variable {env!r} is not set")
        token = os.environ[env]
    return TargetSpec(name, address, str(item.get("model", "")), float(cost), tuple(tags),
                      _tls(item.get("tls"), f"{where}.tls", base, kind), token, parse_limits(item, where), kind,
                      _timeouts(item.get("timeouts"), f"{where}.timeouts"),
                      _seed(item.get("seed_profile"), f"{where}.seed_profile"),
                      _breaker(item.get("breaker"), f"{where}.breaker"), _max_concurrency(item, where),
                      _tokenizer(item, where, base), item.get("stream_tools", True))


def _tokenizer(item: dict, where: str, base: Path) -> str:
    path = item.get("tokenizer", "")
    if not isinstance(path, str):
        raise ValueError(f"{where}.tokenizer must be a path (a model directory or tokenizer.json), got {path!r}")
    if path and not Path(path).is_absolute():
        path = str(base / path)
    if path and not (Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)).is_file():
        raise ValueError(f"{where}.tokenizer: {path} is neither a tokenizer.json nor a directory holding one")
    return path


def _max_concurrency(item: dict, where: str) -> int:
    value = item.get("max_concurrency", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}.max_concurrency must be an integer >= 0 (0: no bound), got {value!r}")
    return value


def _breaker(item: Any, where: str) -> BreakerSettings:
    if item is None:
        return BreakerSettings()
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object {{failures, open_s}}")
    _check_keys(item, {"failures", "open_s"}, where)
    failures = item.get("failures", BreakerSettings.failures)
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
        raise ValueError(f"{where}.failures must be an integer >= 1, got {failures!r}")
    return BreakerSettings(failures, _number(item, "open_s", where, BreakerSettings.open_s, True))


def _number(item: dict, key: str, where: str, default: float, positive: bool) -> float:
    value = item.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
        raise ValueError(f"{where}.{key} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _timeouts(item: Any, where: str) -> TargetTimeouts:
    if item is None:
        return TargetTimeouts()
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object {{connect_s, ttft_s, total_s}}")
    _check_keys(item, {"connect_s", "ttft_s", "total_s"}, where)
    return TargetTimeouts(*(_number(item, key, where, 0.0, False) for key in ("connect_s", "ttft_s", "total_s")))


def _seed(item: Any, where: str) -> SeedProfile | None:
    if item is None:
        return None
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object {{ttft_p50_ms, ttft_p99_ms, tokens_per_second}}")
    keys = ("ttft_p50_ms", "ttft_p99_ms", "tokens_per_second")
    _check_keys(item, set(keys), where)
    missing = [k for k in keys if k not in item]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    seed = SeedProfile(*(_number(item, key, where, 0.0, True) for key in keys))
    if seed.ttft_p99_ms < seed.ttft_p50_ms:
        raise ValueError(f"{where}.ttft_p99_ms ({seed.ttft_p99_ms:g}) must be >= ttft_p50_ms ({seed.ttft_p50_ms:g})")
    return seed


def _tls(item: Any, where: str, base: Path, kind: str) -> TargetTLS | None:
    if item is None:
        return None
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object {{ca, cert, key}}")
    _check_keys(item, {"ca", "cert", "key"} | ({"verify"} if kind != "tokenmill" else set()), where)
    verify = item.get("verify", True)
    if not isinstance(verify, bool):
        raise ValueError(f"{where}.verify must be true or false, got {verify!r}")
    paths = {k: str(base / v) if v and not Path(v).is_absolute() else str(v or "")
             for k, v in item.items() if k != "verify"}
    if bool(paths.get("cert")) != bool(paths.get("key")):
        raise ValueError(f"{where}: cert and key go together")
    for key, path in paths.items():
        if kind != "tokenmill" and path and not Path(path).is_file():
            raise ValueError(f"{where}.{key}: {path} is not a file")
    return TargetTLS(**paths, verify=verify)


def _model(name: str, item: Any, where: str, base: Path) -> ModelSpec:
    if not isinstance(item, dict) or "route" not in item:
        return ModelSpec(name, item)  # the route itself (a target name or a node)
    _check_keys(item, {"route", "sla_ms", "sla_percentile", "expected_output_tokens", "tokenizer",
                       "tool_call_parser", "reasoning_parser"}, where)
    sla = item.get("sla_ms")
    if sla is not None and (isinstance(sla, bool) or not isinstance(sla, (int, float)) or sla <= 0):
        raise ValueError(f"{where}.sla_ms must be a number > 0, got {sla!r}")
    percentile = item.get("sla_percentile", 50)
    if percentile not in (50, 99):
        raise ValueError(f"{where}.sla_percentile must be 50 or 99, got {percentile!r}")
    expected = item.get("expected_output_tokens", DEFAULT_EXPECTED_OUTPUT_TOKENS)
    if isinstance(expected, bool) or not isinstance(expected, int) or expected < 1:
        raise ValueError(f"{where}.expected_output_tokens must be an integer >= 1, got {expected!r}")
    tokenizer = item.get("tokenizer", "")
    if tokenizer and not Path(tokenizer).is_absolute():
        tokenizer = str(base / tokenizer)
    parser = item.get("tool_call_parser", "")
    if parser != "" and parser not in PARSER_SETTINGS:
        raise ValueError(f"{where}.tool_call_parser must be one of {list(PARSER_SETTINGS)}, got {parser!r}")
    reasoning = item.get("reasoning_parser", "")
    if reasoning != "" and reasoning not in REASONING_PARSER_SETTINGS:
        raise ValueError(f"{where}.reasoning_parser must be one of {list(REASONING_PARSER_SETTINGS)}, "
                         f"got {reasoning!r}")
    return ModelSpec(name, item["route"], None if sla is None else float(sla), percentile, expected, tokenizer,
                     parser, reasoning)


def parse_routes(data: Any, origin: str = "routes", base: Path | None = None) -> RoutesFile:
    """Check a routes document (already parsed from YAML/JSON); relative paths are under ``base``."""
    base = base or Path.cwd()
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected an object with targets and models")
    _check_keys(data, {"targets", "models", "default_model"}, origin)
    raw_targets, raw_models = data.get("targets"), data.get("models")
    if not isinstance(raw_targets, list) or not raw_targets:
        raise ValueError(f"{origin}: targets must be a non-empty list")
    targets = tuple(_target(item, f"{origin}: targets[{i}]", base) for i, item in enumerate(raw_targets))
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{origin}: target name {duplicate!r} is used twice")
    if not isinstance(raw_models, dict) or not raw_models:
        raise ValueError(f"{origin}: models must be a non-empty object of model id -> route")
    models = {str(k): _model(str(k), v, f"{origin}: models.{k}", base) for k, v in raw_models.items()}
    default = data.get("default_model", next(iter(models)))
    if default not in models:
        raise ValueError(f"{origin}: default_model {default!r} is not among the models {sorted(models)}")
    return RoutesFile(targets, models, default)


def load_routes(path: str | Path) -> RoutesFile:
    """Read and check a routes file: JSON when it ends in .json, else YAML (JSON is YAML too)."""
    origin = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"routes file {origin}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if origin.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"routes file {origin}: does not parse: {exc}") from None
    return parse_routes(data, f"routes file {origin}", Path(path).resolve().parent)
