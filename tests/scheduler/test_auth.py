"""Auth tokens file, tenant lookup, per-tenant rules and token budgets: no sockets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.errors import PermissionDeniedError, ResourceExhaustedError
from services.scheduler.auth import AuthInterceptor, Tenant, bearer_token, load_auth_tokens, reload_auth
from services.scheduler.token_budget import RATE_WINDOW_S, TokenBudget


def write(tmp_path, data) -> str:
    path = tmp_path / "tokens.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    path.chmod(0o600)
    return str(path)


def test_tokens_map_to_tenants_and_unknown_ones_to_none(tmp_path):
    table = load_auth_tokens(write(tmp_path, [
        {"token": "alpha-secret", "tenant": "a"},
        {"token": "beta-secret", "tenant": "b", "models": ["stories260K"], "max_priority": 0,
         "tokens_per_minute": 100},
    ]))
    assert len(table) == 2
    assert table.authenticate("alpha-secret") == Tenant("a", max_priority=0)  # the default priority at most
    assert table.authenticate("beta-secret") == Tenant("b", ("stories260K",), 0, 100)
    for wrong in ("", "alpha", "alpha-secret ", "ALPHA-SECRET", "beta-secretX", "\udcff"):
        assert table.authenticate(wrong) is None
    assert table.budget(Tenant("a")) is None and table.budget(table.authenticate("beta-secret")).limit == 100


@pytest.mark.parametrize(("data", "message"), [
    ("not json", "not JSON"),
    ([], "expected a non-empty JSON list"),
    ([{"tenant": "a"}], r"entry 0: token must be a non-empty string"),
    ([{"token": " x", "tenant": "a"}], r"entry 0: token must be a non-empty string without surrounding spaces"),
    ([{"token": "x", "tenant": ""}], r"entry 0: tenant must be a non-empty string"),
    ([{"token": "x", "tenant": "a"}, {"token": "x", "tenant": "b"}], r"entry 1: its token is already given"),
    ([{"token": "x", "tenant": "a", "tokens_per_minute": 0}], r"entry 0: tokens_per_minute must be an integer >= 1"),
    ([{"token": "x", "tenant": "a", "max_priority": "high"}], r"entry 0: max_priority must be an integer"),
    ([{"token": "x", "tenant": "a", "models": "m"}], r"entry 0: models must be a list of model names"),
    ([{"token": "x", "tenant": "a", "superuser": True}], r"entry 0 has unknown fields \['superuser'\]"),
    ([{"token": "x", "tenant": "a", "admin": "yes"}], r"entry 0: admin must be true or false, got 'yes'"),
    ([{"token": "x", "tenant": "a", "may_set_fairness_key": "yes"}], r"may_set_fairness_key must be true or false"),
])
def test_a_bad_tokens_file_is_refused_naming_the_entry(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        load_auth_tokens(write(tmp_path, data))


def test_a_missing_tokens_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"auth_tokens_file .*absent.json: cannot read it"):
        load_auth_tokens(tmp_path / "absent.json")


def test_a_tenant_jumps_ahead_only_where_its_entry_says_it_may(tmp_path):
    table = load_auth_tokens(write(tmp_path, [{"token": "plain-secret", "tenant": "plain"},
                                              {"token": "any-secret", "tenant": "any", "max_priority": None}]))
    plain, anything = table.authenticate("plain-secret"), table.authenticate("any-secret")
    plain.check_request("m", 0)
    plain.check_request("m", 7)
    for urgent in (-1, -(2**31)):
        with pytest.raises(PermissionDeniedError, match=f"may not ask for priority {urgent}; .*max_priority=0"):
            plain.check_request("m", urgent)
    anything.check_request("m", -(2**31))


def test_bearer_token_parsing():
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("x-other", "1"), ("authorization", "bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) == ""  # present but not a bearer token
    assert bearer_token([("x-other", "1")]) is None and bearer_token(None) is None


def test_only_a_trusted_tenant_splits_its_share_by_fairness_key(tmp_path):
    table = load_auth_tokens(write(tmp_path, [{"token": "gw-secret", "tenant": "gw", "may_set_fairness_key": True},
                                              {"token": "plain-secret", "tenant": "plain"}]))
    gateway, plain = table.authenticate("gw-secret"), table.authenticate("plain-secret")
    assert gateway.scheduling_tenant("") == "gw" and plain.scheduling_tenant("") == "plain"
    assert gateway.scheduling_tenant("team-a") == '["gw", "team-a"]' != gateway.scheduling_tenant("team-b")
    # Another tenant naming fresh keys would outnumber the rest: its keys are ignored.
    assert plain.scheduling_tenant("team-a") == plain.scheduling_tenant("sybil-1") == "plain"


def test_tenant_rules_name_what_was_refused():
    tenant = Tenant("b", models=("stories260K",), max_priority=0)
    tenant.check_request("stories260K", 0)
    tenant.check_request("stories260K", 5)
    with pytest.raises(PermissionDeniedError, match=r"tenant 'b' may not use model 'other' \(allowed: stories260K\)"):
        tenant.check_request("other", 0)
    with pytest.raises(PermissionDeniedError, match=r"may not ask for priority -1; its most urgent priority is "
                                                    r"max_priority=0"):
        tenant.check_request("stories260K", -1)


def test_token_budget_slides_over_a_minute():
    now = [100.0]
    budget = TokenBudget(limit=50, clock=lambda: now[0])
    budget.reserve("b", 30)
    budget.spend(10)
    assert budget.used() == 40
    with pytest.raises(ResourceExhaustedError, match=r"tenant 'b' has used 40 of its tokens_per_minute=50") as error:
        budget.reserve("b", 11)
    assert error.value.retry_after_s == pytest.approx(RATE_WINDOW_S)
    now[0] += 30.0
    with pytest.raises(ResourceExhaustedError) as error:
        budget.reserve("b", 11)
    assert error.value.retry_after_s == pytest.approx(RATE_WINDOW_S - 30.0)
    now[0] += RATE_WINDOW_S - 30.0  # the first charges leave the window
    budget.reserve("b", 50)
    assert budget.used() == 50


def test_a_reservation_settles_to_what_the_request_used_however_it_ended():
    now = [0.0]
    budget = TokenBudget(limit=100, clock=lambda: now[0])
    first = budget.reserve("b", 60)  # prompt 10 + max_tokens 50
    with pytest.raises(ResourceExhaustedError):
        budget.reserve("b", 60)  # reserved, not yet used: many tiny prompts cannot pass the budget
    now[0] += 1.0
    budget.settle(first, 10 + 5)  # cancelled after 5 tokens: charged 15, 45 given back
    budget.settle(first, 0)  # once
    assert budget.used() == 15
    now[0] = 30.0
    second = budget.reserve("b", 80)
    budget.settle(second, 90)  # more than reserved (no max_tokens cap): the excess is charged now
    assert budget.used() == 105
    now[0] = RATE_WINDOW_S + 0.5  # the first reservation ages out by its admission time
    assert budget.used() == 90
    now[0] = RATE_WINDOW_S + 30.5
    assert budget.used() == 0
    late = budget.reserve("b", 40)
    now[0] += RATE_WINDOW_S + 1  # settled after it left the window: nothing left to give back
    budget.settle(late, 1)
    assert budget.used() == 0

def test_a_tokens_file_others_may_read_is_refused(tmp_path):
    path = write(tmp_path, [{"token": "x", "tenant": "a"}])
    for mode in (0o644, 0o604, 0o660, 0o602):
        Path(path).chmod(mode)
        with pytest.raises(ValueError, match=rf"open to others or writable by its group \(mode {mode:04o}\); make it "
                                             r"private"):
            load_auth_tokens(path)
    for mode in (0o400, 0o440, 0o640):  # group read: a Kubernetes Secret's fsGroup
        Path(path).chmod(mode)
        assert len(load_auth_tokens(path)) == 1


def test_a_reload_swaps_the_tenants_and_keeps_the_budgets_used():
    class Owner:
        auth_table = None

    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        path = write(Path(folder), [{"token": "a-token", "tenant": "a", "tokens_per_minute": 100}])
        interceptor = AuthInterceptor(load_auth_tokens(path))
        budget = interceptor.table.budget(Tenant("a"))
        budget.reserve("a", 60)
        write(Path(folder), [{"token": "a-token-2", "tenant": "a", "tokens_per_minute": 80},
                             {"token": "b-token", "tenant": "b"}])
        owner = Owner()
        table = reload_auth(path, interceptor, [owner])
        assert interceptor.table is table is owner.auth_table
        assert table.authenticate("a-token") is None and table.authenticate("b-token") == Tenant("b", max_priority=0)
        kept = table.budget(table.authenticate("a-token-2"))
        assert kept is budget and kept.limit == 80 and kept.used() == 60
        Path(path).write_text("not json")
        assert reload_auth(path, interceptor, [owner]) is None and interceptor.table is table
