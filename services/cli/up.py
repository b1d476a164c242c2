"""``tokenmill up``: start the four services locally with the default model (``--replicas N``:
N engines), the gateway in front of them (OpenAI-compatible HTTP on 127.0.0.1:8000, the routed
gRPC API on 50050), stream a demo generation (one chat turn when the model has a chat template,
else a story continued), print a curl and an openai example, then serve until Ctrl-C and shut
down gracefully. A crashed service is restarted."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.cli.terminal import stream_to_terminal
from services.common.pb.tokenmill.v1 import generation_pb2
from services.common.settings import parse_config, setting
from services.runtime.model.attention.names import KV_CACHE_DTYPE_NAMES
from services.stack.client import build_request
from services.stack.gateway_launcher import GatewayProcess, replica_routes
from services.stack.launcher import LaunchConfig, Launcher

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = str(REPO_ROOT / "models" / "stories260K")
DEMO_MAX_TOKENS = 96


@dataclass
class UpConfig:
    """tokenmill up: start the four services locally with the default model, stream a demo
    generation, then serve until Ctrl-C."""

    model: str = setting(DEFAULT_MODEL, env="TOKENMILL_MODEL", path=True)
    """Model directory (default: the shipped stories260K)."""
    host: str = setting("127.0.0.1", env="TOKENMILL_SCHEDULER_HOST")
    """Public API host."""
    port: int = setting(50051, env="TOKENMILL_SCHEDULER_PORT")
    """Public API port."""
    tokenizer_port: int = setting(0, env="TOKENMILL_TOKENIZER_PORT")
    """Tokenizer port (0 = any free port)."""
    executor_port: int = setting(0, env="TOKENMILL_EXECUTOR_PORT")
    """Executor port (0 = any free port)."""
    drafter_port: int = setting(0, env="TOKENMILL_DRAFTER_PORT")
    """Drafter port (0 = any free port)."""
    log_dir: str = setting(".tokenmill/logs", env="TOKENMILL_LOG_DIR", path=True)
    """Where each service writes its JSON log."""
    executors: int = setting(1, env="TOKENMILL_EXECUTORS")
    """Executors behind the scheduler, each with its own KV pool (requests are placed on the one holding their longest
    cached prefix, else the least loaded; a lost one's requests move to the others)."""
    prefill_executors: int = setting(0, env="TOKENMILL_PREFILL_EXECUTORS")
    """prefill/decode disaggregation: executors that compute prompts (with --decode-executors; replaces --executors)."""
    decode_executors: int = setting(0, env="TOKENMILL_DECODE_EXECUTORS")
    """prefill/decode disaggregation: executors that decode, the KV of each prompt copied to them from the prefill
    executor."""
    executor_arg: tuple[str, ...] = setting((), repeat=True)
    """Extra flag passed to every executor, e.g. --executor-arg=--dtype=bf16 (repeatable)."""
    kv_cache_dtype: str | None = setting(None, choices=KV_CACHE_DTYPE_NAMES)
    """Executor KV-cache storage (auto = the model's dtype; int8 / fp8_e4m3 are quantized with a scale per token per
    kv head, ~1.9x the tokens of bf16 in the same memory); same as --executor-arg=--kv-cache-dtype=DTYPE."""
    drafter_arg: tuple[str, ...] = setting((), repeat=True)
    """Extra flag passed to the drafter, e.g. --drafter-arg=--method=draft_model (repeatable)."""
    speculate: int | None = setting(None)
    """Speculative decoding with up to K drafts per sequence per step from the drafter (n-gram unless
    --drafter-arg=--method=draft_model ...); same as --scheduler-arg=--num-speculative-tokens=K
    --drafter-arg=--num-speculative-tokens=K."""
    scheduler_arg: tuple[str, ...] = setting((), repeat=True)
    """Extra flag passed to the scheduler, e.g. --scheduler-arg=--max-num-seqs=64 (repeatable)."""
    chat_template: str = setting("")
    """Chat template for the tokenizer(s), replacing the model's or standing in for none: a Jinja file's path or the
    template's text inline (holding {{ or {%)."""
    replicas: int = setting(1, env="TOKENMILL_REPLICAS")
    """Engines to start, each its own tokenizer, executor(s), drafter and scheduler (the first on --port, the others
    on free ports), routed by the gateway."""
    http_port: int = setting(8000, env="TOKENMILL_GATEWAY_HTTP_PORT")
    """The gateway's OpenAI-compatible HTTP port (0 = any free port)."""
    gateway_port: int = setting(50050, env="TOKENMILL_GATEWAY_PORT")
    """The gateway's routed Generation gRPC port (0 = any free port)."""
    gateway: bool = setting(True)
    """Start the gateway in front of the engine(s) (--no-gateway: the engines alone)."""
    gateway_arg: tuple[str, ...] = setting((), repeat=True)
    """Extra flag passed to the gateway, e.g. --gateway-arg=--request-timeout-s=60 (repeatable)."""
    tls: bool = setting(False)
    """MTLS on every hop, with a throwaway local CA and certificates for 127.0.0.1/localhost written to the run
    directory (their paths are printed)."""
    demo_prompt: str = setting("Once upon a time")
    """Prompt of the demo generation (models without a chat template)."""
    demo_chat: str = setting("What is the capital of France?")
    """User message of the demo conversation (models with a chat template)."""
    demo: bool = setting(True)
    """Stream a demo generation once the stack serves (--no-demo: skip it); with engine auth
    (--scheduler-arg=--auth-tokens-file=FILE) it presents a token of FILE whose tenant may use the model, and a
    demo that fails is reported, never stops the stack."""
    exit_after_demo: bool = setting(False)
    """Stop after the demo instead of serving."""

    def validate(self) -> None:
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.speculate is not None and self.speculate < 0:
            raise ValueError(f"speculate must be >= 0 (0 = off), got {self.speculate}")
        if self.executors < 1:
            raise ValueError(f"executors must be >= 1, got {self.executors}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if (self.prefill_executors > 0) != (self.decode_executors > 0) or min(self.prefill_executors,
                                                                               self.decode_executors) < 0:
            raise ValueError(f"prefill_executors and decode_executors go together, each >= 1 (got "
                             f"{self.prefill_executors} and {self.decode_executors})")

    @property
    def executor_roles(self) -> list[str]:
        """One role per executor to start."""
        if self.prefill_executors:
            return ["prefill"] * self.prefill_executors + ["decode"] * self.decode_executors
        return ["mixed"] * self.executors


def parse_up_config(argv: list[str] | None = None) -> UpConfig:
    """Flags and TOKENMILL_* variables; exits with status 2 and the field named on a bad value."""
    config = parse_config(UpConfig, argv, prog="tokenmill up")
    try:
        config.validate()
    except ValueError as exc:
        print(f"tokenmill up: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return config


def has_chat_template(model_dir: str) -> bool:
    """True when the model directory ships a chat template (read as the tokenizer service reads it)."""
    from services.tokenizer.text_tokenizer import TextTokenizer

    return TextTokenizer.from_dir(model_dir).chat_template is not None


def demo_request(chat: bool, prompt: str, message: str) -> tuple[str, generation_pb2.GenerateRequest]:
    """(text to echo, request) of the demo: a one-message conversation when the model has a chat
    template (it stops at the end of the assistant's turn), else a plain prompt continued."""
    if chat:
        request = build_request(None, chat=[{"role": "user", "content": message}],
                                max_tokens=DEMO_MAX_TOKENS, temperature=0.0)
        return f"user: {message}\nassistant: ", request
    return prompt, build_request(prompt, max_tokens=DEMO_MAX_TOKENS, temperature=0.0)


def _print_event(text: str) -> None:
    print(f"[tokenmill up] {text}", file=sys.stderr)


def _print_tls(launcher: Launcher) -> None:
    certs = launcher.certificates
    print(f"[tokenmill up] mTLS on every hop; CA {certs.ca}, client certificate {certs.client_cert}, "
          f"key {certs.client_key}\n"
          f"[tokenmill up]   TOKENMILL_TLS_CA={certs.ca} TOKENMILL_TLS_CERT={certs.client_cert} "
          f"TOKENMILL_TLS_KEY={certs.client_key} tokenmill generate --address {launcher.public_address} "
          "\"Once upon\"\n"
          f"[tokenmill up]   grpcurl -cacert {certs.ca} -cert {certs.client_cert} -key {certs.client_key} "
          f"{launcher.public_address} list", file=sys.stderr)


def executor_args(args: UpConfig) -> list[str]:
    """--executor-arg flags, after the ones up has a flag of its own for (a later flag wins)."""
    own = [] if args.kv_cache_dtype is None else [f"--kv-cache-dtype={args.kv_cache_dtype}"]
    return own + list(args.executor_arg)


def scheduler_args(args: UpConfig) -> list[str]:
    """--scheduler-arg flags, after the ones up has a flag of its own for (a later flag wins)."""
    own = [] if args.speculate is None else [f"--num-speculative-tokens={args.speculate}"]
    return own + list(args.scheduler_arg)


def tokenizer_args(args: UpConfig) -> list[str]:
    """--chat-template, a file's path made absolute here (the services need not share our cwd)."""
    if not args.chat_template:
        return []
    path = Path(args.chat_template).expanduser()
    return [f"--chat-template={path.resolve() if path.is_file() else args.chat_template}"]


def drafter_args(args: UpConfig) -> list[str]:
    # The drafter caps k at its own setting: raise it with the scheduler's (it allows up to 32).
    own = [] if not args.speculate else [f"--num-speculative-tokens={args.speculate}"]
    return own + list(args.drafter_arg)


def _launchers(args: UpConfig, launchers: list[Launcher]) -> None:
    """One Launcher per replica, appended to ``launchers`` as each is made (each owns a run
    directory, which the caller removes however this ends): the first on --port (and the fixed
    internal ports), the others on free ports; with several replicas each logs into its own
    LOG_DIR/replica-N."""
    ports = {"tokenizer": args.tokenizer_port, "executor": args.executor_port, "drafter": args.drafter_port}
    for i in range(args.replicas):
        log_dir = args.log_dir if args.replicas == 1 or not args.log_dir else str(Path(args.log_dir) / f"replica-{i}")
        launchers.append(Launcher(LaunchConfig(
            model=args.model, public_host=args.host, public_port=args.port if i == 0 else 0,
            internal_ports={k: v for k, v in ports.items() if v} if i == 0 else {},
            executor_args=executor_args(args), executor_roles=args.executor_roles,
            scheduler_args=scheduler_args(args), drafter_args=drafter_args(args), tokenizer_args=tokenizer_args(args),
            log_dir=log_dir, on_event=_print_event, tls=args.tls)))


def _start_all(launchers: list[Launcher]) -> None:
    """Start the replicas side by side (each loads its model in its own processes)."""
    errors: list[BaseException] = []

    def start(launcher: Launcher) -> None:
        try:
            launcher.start()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(launcher,)) for launcher in launchers]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:  # Ctrl-C / SIGTERM: stop them here, where the signal arrived, and wait for the starts to end
        for launcher in launchers:
            launcher.stop()
        for thread in threads:
            thread.join()
        raise
    if errors:
        for launcher in launchers:
            launcher.stop()
        raise errors[0]


def _gateway(args: UpConfig, launchers: list[Launcher]) -> GatewayProcess:
    first = launchers[0]
    extra = list(args.gateway_arg)
    if first.certificates is not None:
        certs = first.certificates
        extra += ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                  "--tls-client-ca", str(certs.ca), "--backend-tls-ca", str(certs.ca),
                  "--backend-tls-cert", str(certs.client_cert), "--backend-tls-key", str(certs.client_key)]
    routes = replica_routes(Path(args.model).name, [launcher.public_address for launcher in launchers], args.model)
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    return GatewayProcess(routes, first.run_dir / "gateway", args.host, args.gateway_port,
                          args.http_port, log_dir / "gateway.log" if log_dir else None, extra)


def _tokenmill() -> str:
    """The tokenmill command of this interpreter's environment, as a shell word (``.venv/bin/tokenmill``
    need not be on PATH)."""
    script = Path(sys.executable).with_name("tokenmill")
    return shlex.quote(str(script)) if script.exists() else f"{shlex.quote(sys.executable)} -m services.cli.main"


def _print_examples(gateway: GatewayProcess, model_id: str, chat: bool, auth_file: str = "") -> None:
    """A curl and an openai command that work as printed (the openai package is installed with the
    test requirements, in this interpreter's environment); with engine auth they need a token of
    ``auth_file``, which is not printed."""
    base, model = gateway.http_base, json.dumps(model_id)
    if chat:
        body = {"model": model_id, "messages": [{"role": "user", "content": "Tell me a joke"}], "max_tokens": 64}
        path = "/v1/chat/completions"
        call = (f'chat.completions.create(model={model}, messages=[{{"role": "user", "content": "Tell me a joke"}}], '
                'max_tokens=64).choices[0].message.content')
    else:
        body = {"model": model_id, "prompt": "Once upon a time", "max_tokens": 64}
        path = "/v1/completions"
        call = f'completions.create(model={model}, prompt="Once upon a time", max_tokens=64).choices[0].text'
    key, header = ('os.environ["TOKENMILL_TOKEN"]', ' -H "Authorization: Bearer $TOKENMILL_TOKEN"') if auth_file \
        else ('"none"', "")
    code = (("import os; " if auth_file else "") +
            f'from openai import OpenAI; print(OpenAI(base_url="{base}/v1", api_key={key}).{call})')
    print(f"[tokenmill up] OpenAI-compatible API: {base}/v1 (model {model}); routed gRPC: {gateway.grpc_address}\n"
          + (f"[tokenmill up]   (engine auth on: export TOKENMILL_TOKEN=<a token of {auth_file}>)\n" if auth_file
             else "") +
          f"[tokenmill up]   curl -s {base}{path} -H 'Content-Type: application/json'{header} "
          f"-d {shlex.quote(json.dumps(body))}\n"
          f"[tokenmill up]   {shlex.quote(sys.executable)} -c {shlex.quote(code)}", file=sys.stderr)


def auth_tokens_file(args: UpConfig) -> str:
    """The scheduler's --auth-tokens-file, as the scheduler will read it from the flags up passes it
    and the environment it inherits (empty: no engine auth)."""
    from services.common.settings import add_config_arguments
    from services.scheduler.config import SchedulerServiceConfig

    parser = argparse.ArgumentParser(add_help=False)
    try:
        add_config_arguments(parser, SchedulerServiceConfig)
        known, _ = parser.parse_known_args(scheduler_args(args))
    except (ValueError, SystemExit):
        return ""  # a bad scheduler flag: the scheduler reports it as it starts
    return known.auth_tokens_file


def _demo(args: UpConfig, address: str, chat: bool, launcher: Launcher, auth_file: str) -> bool:
    """Stream the demo; True when it finished. A demo that cannot run or fails is reported, and
    the stack serves on regardless."""
    from services.scheduler.auth import load_auth_tokens

    model_id = Path(args.model).name
    token = None
    try:
        if auth_file:
            token = load_auth_tokens(auth_file).token_for(model_id)
            if token is None:
                _print_event(f"demo skipped: no tenant of {auth_file} may use model {model_id!r}")
                return False
        echo, request = demo_request(chat, args.demo_prompt, args.demo_chat)
        print(f"[tokenmill up] demo (greedy, at most {DEMO_MAX_TOKENS} tokens"
              + (", with a tenant's token" if token else "") + "):\n", file=sys.stderr)
        sys.stdout.write(echo)
        stream_to_terminal(address, request, tls=launcher.client_tls, token=token)
    except grpc.RpcError as exc:
        sys.stdout.write("\n")
        _print_event(f"demo failed: {exc.code().name}: {exc.details()}; the stack keeps serving")
        return False
    except (ValueError, OSError) as exc:
        _print_event(f"demo failed: {exc}; the stack keeps serving")
        return False
    return True


def _stop(gateway: GatewayProcess | None, launchers: list[Launcher]) -> None:
    """The gateway first (client streams end cleanly), then the engines; then their run directories.
    A signal meanwhile is told to wait (an interrupted stop would leave processes and files)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: _print_event("still shutting down ..."))
    if gateway is not None:
        gateway.stop()
    for launcher in launchers:
        launcher.stop()
        launcher.remove_run_dir()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM while starting: as Ctrl-C, unwinds to main's clean-up."""
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    args = parse_up_config(argv)
    # From here every way out stops what was started: Ctrl-C raises KeyboardInterrupt, SIGTERM
    # too, and main's finally stops the services and removes their run directories. (The
    # services also end by themselves if this process dies unstopped: parent_watch.py.)
    signal.signal(signal.SIGTERM, _interrupt)
    # Ctrl-C is handled here whatever up inherited: started as a shell's background job (or by a
    # runner that ignores SIGINT) it would otherwise ignore the interrupt until it serves.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    launchers: list[Launcher] = []
    gateway: GatewayProcess | None = None
    try:
        _launchers(args, launchers)
        engines = "an engine" if args.replicas == 1 else f"{args.replicas} engines"
        print(f"[tokenmill up] starting {engines} (tokenizer, executor, drafter and scheduler) with {args.model}"
              + (" and the gateway" if args.gateway else "") + " ...", file=sys.stderr)
        try:
            _start_all(launchers)
            if args.gateway:
                gateway = _gateway(args, launchers)
                gateway.start()
        except (RuntimeError, TimeoutError) as exc:
            print(f"[tokenmill up] failed to start: {exc}", file=sys.stderr)
            return 1
        return _serve(args, launchers, gateway)
    except KeyboardInterrupt:
        print("\n[tokenmill up] interrupted while starting", file=sys.stderr)
        return 130
    finally:
        print("[tokenmill up] shutting down ...", file=sys.stderr)
        _stop(gateway, launchers)


def _serve(args: UpConfig, launchers: list[Launcher], gateway: GatewayProcess | None) -> int:
    """Print where the stack serves, stream the demo, serve until Ctrl-C / SIGTERM; the exit status."""
    for index, launcher in enumerate(launchers):
        tag = "" if len(launchers) == 1 else f"[{index}]"
        for name, svc in launcher.services.items():
            print(f"[tokenmill up] {name + tag:<12} SERVING on {svc.address} (pid {svc.process.pid})", file=sys.stderr)
    address = gateway.grpc_address if gateway is not None else launchers[0].public_address
    print(f"[tokenmill up] public API: {launchers[0].public_address}  (logs in {args.log_dir})", file=sys.stderr)
    if launchers[0].certificates is not None:
        _print_tls(launchers[0])
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    status = 0
    chat = bool(args.chat_template) or has_chat_template(args.model)
    auth_file = auth_tokens_file(args)
    if gateway is not None:
        _print_examples(gateway, Path(args.model).name, chat, auth_file)
    if args.demo and not _demo(args, address, chat, launchers[0], auth_file):
        status = 1
    if not args.exit_after_demo:
        status = 0
        example = '--chat "Tell me a joke"' if chat else '"Once upon"'
        print(f"[tokenmill up] serving on {address}; try `{_tokenmill()} generate --address {address} {example}`"
              + (" with TOKENMILL_TOKEN set" if auth_file else "")
              + ". Ctrl-C to stop.", file=sys.stderr)
        stop.wait()
    return status
