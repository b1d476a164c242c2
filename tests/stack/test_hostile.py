"""A hostile client against a real stack (tokenizer, executor and scheduler servers on loopback,
one per module): what one tenant sends must never end, slow or reveal another tenant's streams.

The model is stories260K with its config vocab padded to 1,024 rows past its tokenizer's 512
ids (services/tools/padded_vocab.py), as Qwen2-family checkpoints ship theirs. Here: ids past
the tokenizer and the padded rows, hostile structured outputs (a grammar that crashed the
scheduler's compile, patterns that stalled every stream) beside a timed victim stream, oversized requests, the prefix cache, token budgets, the
per-tenant queue share, request ids, callers without a token, what messages reveal, a second
Step session, on two executors behind the one scheduler. The local parts of each finding, and those that need a stack of their own, are
tested beside their modules:

- a stream the detokenizer refuses, drafts past the vocabulary: tests/scheduler/test_hostile_engine.py
- structured outputs past the bounds, a grammar that crashes its compile worker (quarantined),
  the compile deadline and each tenant's share of the workers: tests/scheduler/test_grammar_compiler.py;
  a grammar failing in the executor ends its request alone: tests/inprocess/test_grammar_failures.py
- the padded rows masked in every sampling path: tests/executor/test_padded_vocab.py
- per-stream Detokenize failures: tests/tokenizer/test_tokenizer_service.py, test_detokenizer.py
- sizes on the message, the message limit: tests/scheduler/test_request_limits.py
- chat counts, template deadlines, special-token text in messages: tests/tokenizer/test_hostile_chat.py
- cache scopes, budgets, the queue share, refusal logs: tests/scheduler/test_block_manager.py,
  test_auth.py, test_admission.py, tests/common/test_log_limit.py
- plan fields, silent sessions, allowed client certificates: tests/executor/test_executor_service.py,
  test_step_guard.py, tests/stack/test_tls_stack.py
- KV copies between executors (sizes, kept channels, the executors' certificate for ReadKVBlocks
  alone): tests/executor/test_kv_transfer.py, tests/stack/test_tls_stack.py
- a local process against the executors (no call without the internal secret, no read without
  a grant, no pull outside --kv-peers), on real processes: tests/stack/test_hostile_executors.py
- the gateway's lists counted before validation, its body limit: tests/gateway/test_gateway_openai.py
- the gateway under hostile HTTP clients (a disconnect aborts non-streamed work, messages over the
  engine's limit, slow and idle connections, API keys keeping tenants apart in the prefix cache,
  a target that refuses the gateway): tests/gateway/test_gateway_hostile.py; the keys file:
  tests/gateway/test_api_keys.py; tool-call parsers linear in the reply:
  tests/gateway/test_tool_call_parsers.py; the Kubernetes gateway never keyless:
  tests/deploy/test_gateway_manifest.py
- GetProfile's cost: tests/scheduler/test_profile_cache.py
- binds, /metrics on loopback, concurrent calls, pings: tests/common/test_bind_policy.py,
  test_server_bootstrap.py
- the tokens file's mode and reload: tests/scheduler/test_auth.py; shard paths:
  tests/runtime/model/test_shard_paths.py; GGUF layer indices: tests/tools/test_gguf_convert.py
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import grpc
import pytest
import pytest_asyncio

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.scheduler.admission import Admission
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.request_release import RequestBox
from services.scheduler.servicer import GenerationServicer
from tests.helpers.padded_vocab import TOKENIZER_VOCAB, padded_vocab_model
from tests.helpers.small_stack import start_small_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")

ATTACKER, VICTIM, BUDGETED, GROUP_A, GROUP_B = "tok-attacker", "tok-victim", "tok-budget", "tok-ga", "tok-gb"
LIMITED = "tok-limited"
TENANTS = [{"token": ATTACKER, "tenant": "attacker"}, {"token": VICTIM, "tenant": "victim"},
           {"token": BUDGETED, "tenant": "budgeted", "tokens_per_minute": 400},
           {"token": GROUP_A, "tenant": "group-a", "cache_group": "team"},
           {"token": GROUP_B, "tenant": "group-b", "cache_group": "team"},
           {"token": LIMITED, "tenant": "limited", "max_priority": 5}]


MAX_NUM_SEQS, MAX_WAITING = 4, 16
"""Few running places, so a flood queues; with five tenants each may hold 16 / 4 queued places."""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps(TENANTS))
    tokens.chmod(0o600)
    model = padded_vocab_model(root / "stories-padded")
    # Two executors: each has its own block manager (and prefix cache) and its own Step session.
    stack = await start_small_stack(model=model, num_blocks=256, executors=2, auth_tokens_file=str(tokens),
                                    limits=SchedulerLimits(max_num_seqs=MAX_NUM_SEQS, max_waiting_requests=MAX_WAITING))
    yield stack
    await stack.stop()


def bearer(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def request(prompt: str | list[int] = "Once upon a time", max_tokens: int = 8, **sampling) -> generation_pb2.GenerateRequest:
    r = generation_pb2.GenerateRequest()
    if isinstance(prompt, str):
        r.text = prompt
    else:
        r.token_ids.ids.extend(prompt)
    r.sampling.temperature = 0.0
    for name, value in sampling.items():
        if name == "logit_bias":
            r.sampling.logit_bias.update(value)
        else:
            setattr(r.sampling, name, value)
    r.stop.max_tokens = max_tokens
    r.stop.ignore_eos = True
    return r


class Outcome:
    def __init__(self) -> None:
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.messages: list[generation_pb2.GenerateResponse] = []
        self.trailers: dict = {}

    @property
    def finished(self) -> generation_pb2.Finished | None:
        last = self.messages[-1] if self.messages else None
        return last.finished if last is not None and last.WhichOneof("event") == "finished" else None

    @property
    def token_ids(self) -> list[int]:
        return [t for m in self.messages if m.WhichOneof("event") == "delta" for t in m.delta.token_ids]

    def completed(self) -> bool:
        """The stream ran to its length (no error, no early end)."""
        return (self.code == grpc.StatusCode.OK and self.finished is not None
                and self.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH)


async def generate(stack, r: generation_pb2.GenerateRequest, token: str | None = VICTIM, timeout: float = 60,
                   on_tokens: asyncio.Event | None = None) -> Outcome:
    outcome = Outcome()
    call = stack.stub.Generate(r, metadata=bearer(token), timeout=timeout)
    try:
        async for message in call:
            outcome.messages.append(message)
            if on_tokens is not None and message.WhichOneof("event") == "delta" and message.delta.token_ids:
                on_tokens.set()
    except grpc.aio.AioRpcError as err:
        outcome.code, outcome.details = err.code(), err.details() or ""
        outcome.trailers = dict(err.trailing_metadata() or ())
    return outcome


async def while_victim_streams(stack, attack) -> tuple[Outcome, list]:
    """Run ``attack()`` while a victim stream is in flight; the victim's outcome and the attack's results."""
    running = asyncio.Event()
    victim = asyncio.ensure_future(generate(stack, request(max_tokens=300), on_tokens=running))
    await asyncio.wait_for(running.wait(), 30)
    results = await attack()
    return await victim, results


# ---------------------------------------------------------------- a padded vocabulary
async def test_ids_past_the_tokenizer_are_refused_and_never_end_another_tenants_stream(stack):
    info = await stack.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=bearer(VICTIM), timeout=10)
    assert info.vocab_size == TOKENIZER_VOCAB  # the config says 1,024 rows

    async def attack():
        return await asyncio.gather(
            generate(stack, request([1, TOKENIZER_VOCAB + 38]), ATTACKER),
            generate(stack, request("Once", logit_bias={TOKENIZER_VOCAB + 38: 100.0}), ATTACKER),
            generate(stack, _stop_id_request(), ATTACKER))

    victim, (by_prompt, by_bias, by_stop) = await while_victim_streams(stack, attack)
    assert by_prompt.code == grpc.StatusCode.INVALID_ARGUMENT
    assert by_prompt.details == f"prompt_token_ids[1] = {TOKENIZER_VOCAB + 38} is outside [0, {TOKENIZER_VOCAB})"
    assert by_bias.code == grpc.StatusCode.INVALID_ARGUMENT and f"{TOKENIZER_VOCAB + 38}" in by_bias.details
    assert by_stop.code == grpc.StatusCode.INVALID_ARGUMENT and f"{TOKENIZER_VOCAB + 38}" in by_stop.details
    assert victim.completed(), (victim.code, victim.details, victim.finished)
    assert len(victim.token_ids) == 300


def _stop_id_request() -> generation_pb2.GenerateRequest:
    r = request("Once")
    r.stop.stop_token_ids.append(TOKENIZER_VOCAB + 38)
    return r


async def test_padded_logit_rows_are_never_sampled(stack):
    # The padded rows outscore the real ones: unmasked, a plain greedy request samples them.
    outcomes = await asyncio.gather(generate(stack, request(max_tokens=40)),
                                    generate(stack, request(max_tokens=40, temperature=1.5, seed=7)),
                                    generate(stack, request(max_tokens=40, temperature=1.0, top_k=100, logprobs=5)))
    for outcome in outcomes:
        assert outcome.completed(), (outcome.code, outcome.details, outcome.finished)
        assert max(outcome.token_ids) < TOKENIZER_VOCAB


# ---------------------------------------------------------------- sizes before work
async def test_millions_of_chat_messages_are_refused_before_they_are_parsed(stack):
    r = generation_pb2.GenerateRequest()
    for _ in range(2_500_000):
        r.chat.messages.add(role="u")
    huge_role = generation_pb2.GenerateRequest()
    huge_role.chat.messages.add(role="u" * 3_900_000, content="hi")
    stop_ids = request("Once")
    stop_ids.stop.stop_token_ids.extend(range(1000, 3_001_000))

    async def attack():
        started = time.monotonic()
        outcomes = await asyncio.gather(*(generate(stack, x, ATTACKER) for x in (r, huge_role, stop_ids)))
        return outcomes, time.monotonic() - started

    victim, (outcomes, elapsed) = await while_victim_streams(stack, attack)
    for outcome in outcomes:
        assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (outcome.code, outcome.details)
        assert "larger than max" in outcome.details
    assert elapsed < 5.0  # was 6.6-8.2 s for the first alone, on the scheduler's event loop
    assert victim.completed()


async def test_a_generate_stream_does_not_hold_its_request_message(stack):
    # The servicer takes the fields it needs and lets the message go; RequestRelease makes the
    # server hold a box instead of the message, so nothing keeps a finished intake's body alive.
    servicer = GenerationServicer(stack.scheduler.app, Admission(8))
    message = request(max_tokens=20)
    message.stop.stop.extend(["never-seen-in-stories-" + str(i) for i in range(16)])
    box = RequestBox(message)
    baseline = sys.getrefcount(message)
    stream = servicer.Generate(box.take(), None)
    try:
        first = await stream.__anext__()
        assert first.WhichOneof("event") == "started"
        assert box.message is None
        assert sys.getrefcount(message) == baseline - 1  # only this test holds it now (the box let go)
    finally:
        await stream.aclose()
    await stack.wait_idle()


# ---------------------------------------------------------------- tenants kept apart
def prefix_prompt(seed: int, length: int = 305) -> list[int]:
    return [1] + [3 + (seed * 7 + i * 13) % 500 for i in range(length - 1)]


async def cached_tokens(stack, prompt: list[int], token: str) -> int:
    outcome = await generate(stack, request(prompt, max_tokens=2), token)
    assert outcome.completed(), (outcome.code, outcome.details)
    return outcome.finished.usage.cached_tokens


async def test_the_prefix_cache_tells_no_tenant_what_another_sent(stack):
    prompt = prefix_prompt(1)
    assert await cached_tokens(stack, prompt, VICTIM) == 0
    # The attacker guesses the victim's prompt exactly: no block of it is shared, and no reuse
    # shows in cached_tokens (at 1f402ef it read 304 of 305).
    assert await cached_tokens(stack, prompt, ATTACKER) == 0
    assert await cached_tokens(stack, prompt, VICTIM) == 304  # the victim's own prefix is still reused
    # Tenants an operator put in one cache group share their prefixes.
    shared = prefix_prompt(2)
    assert await cached_tokens(stack, shared, GROUP_A) == 0
    assert await cached_tokens(stack, shared, GROUP_B) == 304
    assert await cached_tokens(stack, shared, VICTIM) == 0


async def test_a_token_budget_reserves_max_tokens_and_charges_every_ending(stack):
    # 400 tokens a minute: each request below reserves 5 prompt + 150 = 155, so two fit and a
    # third does not, however many are sent at once (at 1f402ef eight ran: 2,503 tokens used).
    outcomes = await asyncio.gather(*(generate(stack, request(max_tokens=150), BUDGETED) for _ in range(6)))
    ran = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    refused = [o for o in outcomes if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(ran) == 2 and len(refused) == 4, [(o.code, o.details) for o in outcomes]
    assert all(o.completed() for o in ran)
    assert "tokens_per_minute=400" in refused[0].details and "grpc-retry-pushback-ms" in refused[0].trailers
    # 310 used. A cancelled stream is charged what it generated; the rest of its reservation
    # comes back, so a small request still fits after it.
    started = asyncio.Event()
    r = request(max_tokens=85)
    call = stack.stub.Generate(r, metadata=bearer(BUDGETED), timeout=30)

    async def read_until_tokens():
        async for message in call:
            if message.WhichOneof("event") == "delta" and message.delta.token_ids:
                started.set()
                return

    reader = asyncio.ensure_future(read_until_tokens())
    await asyncio.wait_for(started.wait(), 30)
    call.cancel()
    await reader
    await stack.wait_idle()
    small = await generate(stack, request(max_tokens=20), BUDGETED)  # 25 more: fits only if 90 - used came back
    assert small.completed(), (small.code, small.details)


async def test_request_ids_are_a_namespace_per_tenant(stack):
    r = request(max_tokens=200)
    r.request_id = "only-mine"
    running = asyncio.Event()
    victim = asyncio.ensure_future(generate(stack, r, VICTIM, on_tokens=running))
    await asyncio.wait_for(running.wait(), 30)
    same = request(max_tokens=2)
    same.request_id = "only-mine"
    # The attacker neither learns the id is live (no "already in use") nor can abort it.
    mine = await generate(stack, same, ATTACKER)
    assert mine.completed() and mine.messages[0].started.request_id == "only-mine"
    aborted = await stack.stub.Abort(generation_pb2.AbortRequest(request_id="only-mine"), metadata=bearer(ATTACKER),
                                     timeout=10)
    assert not aborted.found
    outcome = await victim
    assert outcome.completed() and len(outcome.token_ids) == 200
    again = await generate(stack, same, VICTIM)  # the victim's id is free once its request ended
    assert again.completed()


async def test_one_tenant_cannot_fill_the_queue_every_tenant_shares(stack):
    # No --max-waiting-per-tenant: with authentication each tenant may hold a quarter of the
    # queue. The attacker's flood beyond it is refused; the victim's request still gets in.
    flood = [asyncio.ensure_future(generate(stack, request(max_tokens=300), ATTACKER, timeout=120))
             for _ in range(3 * MAX_WAITING)]
    await asyncio.sleep(0.5)
    victim = await generate(stack, request(max_tokens=4), VICTIM, timeout=120)
    assert victim.completed(), (victim.code, victim.details)
    for call in flood:
        call.cancel()
    outcomes = [o for o in await asyncio.gather(*flood, return_exceptions=True) if isinstance(o, Outcome)]
    refused = [o for o in outcomes if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused and all("max_waiting_per_tenant=4" in o.details for o in refused), [o.details for o in refused]
    await stack.wait_idle(timeout=30)


# ---------------------------------------------------------------- callers without a token
async def test_unauthenticated_bodies_are_refused_undecoded_and_their_refusals_barely_logged(stack, capfd):
    undecodable = b"\xff" * 4096  # not a GenerateRequest: decoding it would be INVALID_ARGUMENT
    raw = stack.channel.unary_stream("/tokenmill.v1.Generation/Generate")
    big = request()
    for _ in range(10_000):
        big.stop.stop.append("x")  # within the message limit, and costly to parse
    capfd.readouterr()

    async def attack():
        outcomes = []
        for index in range(200):
            call = raw(undecodable, timeout=10) if index % 2 else stack.stub.Generate(big, timeout=10, metadata=bearer(
                "not-a-token" if index % 4 else None))
            try:
                async for _ in call:
                    pass
                outcomes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as err:
                outcomes.append(err.code())
        return outcomes

    victim, outcomes = await while_victim_streams(stack, attack)
    assert set(outcomes) == {grpc.StatusCode.UNAUTHENTICATED}  # never INVALID_ARGUMENT: never parsed
    assert victim.completed()
    logged = capfd.readouterr()
    refusals = [line for line in (logged.out + logged.err).splitlines() if "unauthenticated_call" in line]
    assert 1 <= len(refusals) <= 5, len(refusals)  # one burst per interval, not 200 lines


# ---------------------------------------------------------------- what a client may learn
async def test_client_visible_messages_name_no_path_or_address(stack):
    info = await stack.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=bearer(VICTIM), timeout=10)
    assert info.model_path == "stories-padded"  # the directory's name, not where it lies
    chat = generation_pb2.GenerateRequest()
    chat.chat.messages.add(role="user", content="hi")  # stories260K ships no chat template
    refused = await generate(stack, chat, VICTIM)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in refused.details
    full = await generate(stack, request(), None)
    for details in (refused.details, full.details, info.model_path):
        assert "/" not in details and "127.0.0.1" not in details, details


async def test_a_second_step_session_is_refused_while_the_scheduler_holds_the_executor(stack):
    # A local process cannot take the executor from the scheduler (its idle session stays up on
    # heartbeats, tests/executor/test_step_guard.py) nor send it plans: only one session runs.
    from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
    from services.common.server import create_channel
    from tests.helpers.service_harness import StreamSession, expect_status

    async def attack():
        refusals = []
        for executor in stack.executors:
            async with create_channel(executor.address) as channel:
                session = StreamSession(executor_pb2_grpc.ExecutorStub(channel).Step)
                refusals.append(await expect_status(session.exchange(executor_pb2.StepRequest(step_id=1)),
                                                    grpc.StatusCode.FAILED_PRECONDITION))
        return refusals

    victim, refusals = await while_victim_streams(stack, attack)
    assert len(refusals) == 2 and all("another Step stream" in details for details in refusals)
    assert victim.completed()


# ---------------------------------------------------------------- hostile structured outputs
def chained_rules(n: int) -> str:
    """A Lark grammar of ``n`` rules each naming the next (~12 bytes a rule): the grammar library
    recursed once per rule in native code; 3,000 overflowed the scheduler's stack (SIGSEGV)."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n - 1)) + f'r{n - 1}: "a"\n'


def constrained(kind: str, spec: str, max_tokens: int = 8, priority: int = 0) -> generation_pb2.GenerateRequest:
    r = request(max_tokens=max_tokens)
    r.stop.ignore_eos = False
    r.priority = priority
    setattr(r.structured_output, kind, spec)
    return r


def nested_repeats(count: int) -> str:
    """58 bytes whose lexer took 2-3 s to compile and whose first masks in the executor 1.9-2.9 s
    (varying ``count`` defeated the caches)."""
    return json.dumps({"type": "string", "pattern": f"^(((a{{{count}}}){{{count}}}){{{count}}}){{{count}}}$"})


async def timed_victim(stack, started: asyncio.Event, max_tokens: int = 400) -> tuple[Outcome, list[float]]:
    """A victim stream and the arrival time of each of its token-carrying messages."""
    outcome, arrivals = Outcome(), []
    try:
        async for message in stack.stub.Generate(request(max_tokens=max_tokens), metadata=bearer(VICTIM), timeout=120):
            outcome.messages.append(message)
            if message.WhichOneof("event") == "delta" and message.delta.token_ids:
                arrivals.append(time.perf_counter())
                started.set()
    except grpc.aio.AioRpcError as err:
        outcome.code, outcome.details = err.code(), err.details() or ""
    return outcome, arrivals


async def test_hostile_structured_outputs_are_refused_at_admission_and_stall_no_other_tenants_stream(stack):
    started = asyncio.Event()
    victim = asyncio.ensure_future(timed_victim(stack, started))
    await asyncio.wait_for(started.wait(), 30)
    began = time.perf_counter()
    attacks = []

    async def attack(r, token=ATTACKER) -> Outcome:
        outcome = await generate(stack, r, token=token)
        attacks.append(outcome)
        return outcome

    deep = chained_rules(990)  # within the rule bound; overflows a compile worker's stack
    # Compiling comes after the tenant's permission check: a refused caller costs no compile
    # (the attacker's identical grammar below is the first to reach a worker, and crashes it).
    denied = await attack(constrained("grammar", deep, priority=0), token=LIMITED)
    assert denied.code == grpc.StatusCode.PERMISSION_DENIED, denied.details
    chain = await attack(constrained("grammar", chained_rules(3000)))
    assert chain.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.grammar defines 3001 rules; the limit is 1000" in chain.details
    crashed = await attack(constrained("grammar", deep))
    assert crashed.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.grammar crashed the grammar compiler (SIGSEGV)" in crashed.details
    for token in (ATTACKER, VICTIM):  # quarantined for every tenant, refused without a compile
        at = time.perf_counter()
        again = await attack(constrained("grammar", deep), token=token)
        assert again.code == grpc.StatusCode.INVALID_ARGUMENT and "is quarantined" in again.details
        assert time.perf_counter() - at < 1.0
    for count in (50, 49, 48, 47):
        repeats = await attack(constrained("json_schema", nested_repeats(count)))
        assert repeats.code == grpc.StatusCode.INVALID_ARGUMENT, (repeats.code, repeats.details)
        assert "structured_output.json_schema pattern" in repeats.details
        assert "the limit is 10,000 (max regex expansion" in repeats.details
    nested = await attack(constrained("json_schema", "[" * 5000 + "]" * 5000))
    assert nested.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.json_schema nests objects and arrays deeper than 64 levels" in nested.details
    attack_s = time.perf_counter() - began
    # The engine still compiles and serves the attacker's fair requests (its worker restarted).
    fair = await attack(constrained("json_schema", json.dumps({"type": "integer"}), max_tokens=6))
    assert fair.code == grpc.StatusCode.OK and fair.finished is not None, fair.details

    outcome, arrivals = await victim
    assert outcome.completed(), (outcome.code, outcome.details)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if began <= b and a <= began + attack_s]
    median = statistics.median(gaps)
    # A 1.9-2.9 s first mask inside a step paused every stream; a compile on the scheduler's own
    # stack killed them. Here the victim's worst gap while the attack ran stays within a small
    # multiple of its own median (a loaded 2-core machine adds its own jitter, hence the floor).
    assert during, "the victim's stream ended before the attack: the test measured nothing"
    assert max(during) < max(0.5, 10 * median), (max(during), median, attack_s)


async def test_an_executor_builds_a_grammar_when_asked_at_admission_and_refuses_one_that_cannot_run(stack):
    # The executor's PrepareGrammar builds a matcher and its first mask beside the step thread;
    # the scheduler calls it for each admitted grammar, and an executor's refusal is the request's.
    from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
    from services.common.server import create_channel

    unbuildable = json.dumps({"grammars": [{"lark_grammar": "start: missing_rule"}]})
    async with create_channel(stack.executors[0].address) as channel:
        prepare = executor_pb2_grpc.ExecutorStub(channel).PrepareGrammar
        refused = await prepare(executor_pb2.PrepareGrammarRequest(grammar=unbuildable), timeout=30)
        assert refused.error.startswith("structured output failed: the grammar does not build")
    fair = await generate(stack, constrained("regex", "(ab|cd){3}", max_tokens=8), token=ATTACKER)
    assert fair.code == grpc.StatusCode.OK and fair.finished is not None, fair.details
    text = "".join(m.delta.text for m in fair.messages if m.WhichOneof("event") == "delta")
    assert len(text) == 6 and set(text) <= set("abcd"), text
