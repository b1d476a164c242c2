"""Requests and tokens per minute as token buckets (services/gateway/rate_limits.py), on an
injected clock: exact waits, the reservation settled to the usage, a request larger than a
minute's budget refused naming max_tokens, the files' fields checked, and each key's own
buckets and metrics."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.gateway.api_keys import load_api_keys
from services.gateway.metrics import GatewayMetrics
from services.gateway.rate_limits import RateLimited, RateLimiter, RateLimits
from services.gateway.routes_file import parse_routes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_refill_continuously():
    clock = Clock()
    limiter = RateLimiter(RateLimits(requests_per_minute=2), "this API key", clock)
    limiter.admit(10).settle()
    limiter.admit(10).settle()
    with pytest.raises(RateLimited) as refused:
        limiter.admit(10)
    # empty; one request refills in 60 / 2 s
    assert refused.value.retry_after_s == pytest.approx(30.0)
    assert refused.value.limit == "requests_per_minute"
    assert "this API key is over its requests_per_minute 2" in str(refused.value)
    clock.now += 29.0
    with pytest.raises(RateLimited) as refused:
        limiter.admit(10)
    assert refused.value.retry_after_s == pytest.approx(1.0)
    clock.now += 1.0
    limiter.admit(10)


def test_tokens_reserved_at_admission_settle_to_prompt_plus_completion():
    clock = Clock()
    limiter = RateLimiter(RateLimits(tokens_per_minute=120), "this API key", clock)  # 2 tokens a second
    first = limiter.admit(60)
    assert limiter.wait_s(61) == (pytest.approx(0.5), "tokens_per_minute")  # 60 left: 61 waits half a second
    first.use(5, 20)
    first.settle()  # 35 of the 60 reserved come back: 95 left
    first.settle()  # once only
    second = limiter.admit(95)
    second.use(40, 95)
    second.settle()  # used 40 more than it reserved: the bucket is 40 below empty
    with pytest.raises(RateLimited) as refused:
        limiter.admit(10)
    assert refused.value.retry_after_s == pytest.approx(25.0) and refused.value.limit == "tokens_per_minute"
    clock.now += 1000.0  # refills up to its capacity, never beyond
    limiter.admit(120)
    with pytest.raises(RateLimited):
        limiter.admit(1)


def test_a_request_larger_than_a_minutes_tokens_is_refused_naming_max_tokens():
    limiter = RateLimiter(RateLimits(tokens_per_minute=100), "this API key", Clock())
    with pytest.raises(InvalidArgumentError, match=r"^max_tokens 101 is more than this API key's tokens_per_minute 100"):
        limiter.admit(101)
    limiter.admit(100)


def write_keys(tmp_path, entries):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    path.chmod(0o600)
    return path


@pytest.mark.parametrize(("extra", "message"), [
    ({"requests_per_minute": 0}, "entry 0: requests_per_minute must be an integer >= 1, got 0"),
    ({"tokens_per_minute": "100"}, "entry 0: tokens_per_minute must be an integer >= 1, got '100'"),
    ({"tokens_per_minute": True}, "entry 0: tokens_per_minute must be an integer >= 1, got True"),
])
def test_a_bad_limit_is_refused_naming_the_entry_and_field(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        load_api_keys(write_keys(tmp_path, [{"key": "sk-a", "tenant": "a", **extra}]))
    routes = {"targets": [{"name": "t", "address": "127.0.0.1:1", **extra}], "models": {"m": "t"}}
    with pytest.raises(ValueError, match=message.replace("entry 0", r"targets\[0\]")):
        parse_routes(routes)


def test_a_targets_limits_are_read_from_the_routes_file():
    routes = parse_routes({"targets": [{"name": "t", "address": "127.0.0.1:1", "requests_per_minute": 600,
                                        "tokens_per_minute": 90000}, {"name": "u", "address": "127.0.0.1:2"}],
                           "models": {"m": "t"}})
    assert routes.targets[0].limits == RateLimits(600, 90000)
    assert not routes.targets[1].limits


def test_each_key_has_its_own_budget_and_its_usage_counted_under_its_tenant(tmp_path):
    metrics = GatewayMetrics()
    keys = load_api_keys(write_keys(tmp_path, [
        {"key": "sk-one", "tenant": "team", "requests_per_minute": 1},
        {"key": "sk-two", "tenant": "team", "requests_per_minute": 1},  # equal but for the secret
        {"key": "sk-free", "tenant": "free"}]), metrics)
    one, two, free = (keys.authenticate(f"Bearer sk-{name}") for name in ("one", "two", "free"))
    grant = keys.admit(one, 50)
    grant.use(7, 30)
    grant.settle()
    with pytest.raises(ResourceExhaustedError) as refused:
        keys.admit(one, 50)
    assert refused.value.retry_after_s > 59
    keys.admit(two, 50).settle()  # its own bucket
    for _ in range(5):
        keys.admit(free, 10**9).settle()  # no limits: admitted, still counted

    def sample(name, **labels):
        return metrics.registry.get_sample_value(f"tokenmill:gateway_{name}", labels)

    assert sample("key_requests_total", tenant="team", outcome="admitted") == 2
    assert sample("key_requests_total", tenant="team", outcome="requests_per_minute") == 1
    assert sample("key_requests_total", tenant="free", outcome="admitted") == 5
    assert sample("key_tokens_total", tenant="team", kind="prompt") == 7
    assert sample("key_tokens_total", tenant="team", kind="completion") == 30
    assert b"sk-one" not in metrics.exposition()
