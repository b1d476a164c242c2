"""The gateway's API keys file: what it accepts, what it refuses (naming the entry and field),
and the per-tenant count of requests in flight."""

from __future__ import annotations

import json

import pytest

from services.common.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from services.gateway.api_keys import load_api_keys


def write(tmp_path, entries, mode=0o600):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    path.chmod(mode)
    return path


def test_keys_name_tenants_and_their_limits(tmp_path):
    keys = load_api_keys(write(tmp_path, [{"key": "sk-a", "tenant": "a"},
                                          {"key": "sk-b", "tenant": "b", "models": ["chat"],
                                           "max_concurrent_requests": 1, "cache_group": "team"}]))
    a, b = keys.authenticate("Bearer sk-a"), keys.authenticate("bearer sk-b")
    assert (a.tenant, a.cache_salt, b.cache_salt) == ("a", "tenant:a", "group:team")
    for wrong in (None, "", "Bearer", "Bearer sk-c", "Basic sk-a", "Bearer sk-a2"):
        with pytest.raises(UnauthenticatedError):
            keys.authenticate(wrong)
    b.check_model("chat")
    with pytest.raises(PermissionDeniedError, match="'stories'"):
        b.check_model("stories")
    with keys.in_flight(b):
        with pytest.raises(ResourceExhaustedError, match="max_concurrent_requests is 1"):
            with keys.in_flight(b):
                pass
        with keys.in_flight(a), keys.in_flight(a):
            pass
    with keys.in_flight(b):  # released
        pass


def test_a_keys_priority_bound_defaults_to_the_default_priority(tmp_path):
    keys = load_api_keys(write(tmp_path, [{"key": "sk-a", "tenant": "a"},
                                          {"key": "sk-b", "tenant": "b", "max_priority": -3},
                                          {"key": "sk-c", "tenant": "c", "max_priority": None}]))
    a, b, c = (keys.authenticate(f"Bearer sk-{name}") for name in "abc")
    a.check_priority(0)
    a.check_priority(2**31 - 1)
    with pytest.raises(InvalidArgumentError, match=r"^priority -2147483648 .*max_priority 0"):
        a.check_priority(-(2**31))
    b.check_priority(-3)
    with pytest.raises(InvalidArgumentError, match="max_priority -3"):
        b.check_priority(-4)
    c.check_priority(-(2**31))


@pytest.mark.parametrize(("entries", "message"), [
    ([], "non-empty JSON list"),
    ([{"key": "sk-a"}], "entry 0: tenant"),
    ([{"key": "sk a", "tenant": "a"}], "entry 0: key must be"),
    ([{"key": "sk-a", "tenant": "a"}, {"key": "sk-a", "tenant": "b"}], "entry 1: its key is already given"),
    ([{"key": "sk-a", "tenant": "a", "max_concurrent_requests": 0}], "max_concurrent_requests must be"),
    ([{"key": "sk-a", "tenant": "a", "token": "x"}], "unknown fields ['token']"),
    ([{"key": "sk-a", "tenant": "a", "max_priority": -(2**31) - 1}], "max_priority must be a 32-bit integer"),
    ([{"key": "sk-a", "tenant": "a", "max_priority": "0"}], "max_priority must be a 32-bit integer"),
])
def test_a_bad_file_is_refused_naming_the_entry(tmp_path, entries, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_api_keys(write(tmp_path, entries))


def test_a_file_others_may_read_is_refused(tmp_path):
    with pytest.raises(ValueError, match="chmod 600"):
        load_api_keys(write(tmp_path, [{"key": "sk-a", "tenant": "a"}], mode=0o644))
