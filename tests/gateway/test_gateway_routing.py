"""Routing strategies on scripted profiles and outcomes: exact rankings, no sockets, no clock."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.gateway.routes_file import ModelSpec, parse_routes
from services.gateway.routing.build import RETRY_ALWAYS, RETRY_FALLBACK, build_route
from services.gateway.routing.estimate import MIN_OBSERVATIONS, PRIOR_SLOWDOWN, ResponseTimeEstimator
from services.gateway.routing.prefix_affinity import prefix_key
from services.gateway.routing.profile import ProfileView
from services.gateway.routing.query import compile_query
from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import TargetState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def profile(ttft50=100.0, ttft99=200.0, tpot50=10.0, tpot99=20.0, running=0, waiting=0, n=10, at=1000.0):
    return ProfileView(at, n, ttft50, ttft99, tpot50, tpot99, 1000.0 / tpot50 if tpot50 else 0.0, 0.1,
                       running, waiting)


def states(**costs: float) -> dict[str, TargetState]:
    return {name: TargetState(name, cost=cost, healthy=True) for name, cost in costs.items()}


def req(max_tokens=100, sla=None, worst=False, prefix="", params=None, metadata=None) -> RouteRequest:
    return RouteRequest("m", max_tokens, sla, worst, prefix, params or {}, metadata or {})


def route(spec, targets, clock=None, seed=0):
    return build_route(ModelSpec("m", spec), targets, rng=random.Random(seed), clock=clock or Clock())


def names(ranking) -> list[str]:
    return [t.name for t in ranking.targets]


# ---------------------------------------------------------------------------- the estimate
def test_profile_estimate_is_ttft_plus_tokens_times_tpot_medians_or_p99s():
    est = ResponseTimeEstimator()
    assert est.estimate_ms(10, 0, False, 0.0) is None
    est.set_profile(profile(ttft50=100, ttft99=300, tpot50=10, tpot99=25))
    assert est.estimate_ms(11, 0, False, 0.0) == pytest.approx(100 + 10 * 10)
    assert est.estimate_ms(11, 0, True, 0.0) == pytest.approx(300 + 10 * 25)


def test_own_observations_fit_latency_as_a_line_in_the_load():
    est = ResponseTimeEstimator()
    est.set_profile(profile(ttft50=500, tpot50=50))
    # Scripted outcomes of a target whose TTFT is 20 + 5*load ms and TPOT 2 + 1*load ms.
    for load in [0, 1, 2, 3, 4, 5, 6, 7] * 3:
        ttft, tpot = 20 + 5 * load, 2 + 1 * load
        est.observe(load, ttft, 11, ttft + 10 * tpot, now=0.0)
    assert est.ttft.count >= MIN_OBSERVATIONS
    # The slope's prior (5 % per request) weighs as 4 points: against 24 spread points, a few %.
    assert est.estimate_ms(11, 10, False, 0.0) == pytest.approx((20 + 50) + 10 * (2 + 10), rel=0.05)
    # p99: the fitted values scaled by the profile's p99/p50 ratios (200/500 -> 1, 20/50 -> 1)
    assert est.estimate_ms(11, 0, True, 0.0) == pytest.approx(20 + 10 * 2, rel=0.05)


def test_points_at_one_load_take_the_prior_slope():
    est = ResponseTimeEstimator()
    for _ in range(10):
        est.observe(2, 100.0, 11, 100.0 + 10 * 10.0, now=0.0)
    # 5 % of the mean per request in flight, relative to the load the points were seen at
    per_request = PRIOR_SLOWDOWN * 100.0 / (1 + PRIOR_SLOWDOWN * 2)
    assert est.ttft.slope == pytest.approx(per_request)
    assert est.ttft.predict(6) == pytest.approx(100.0 + 4 * per_request)


def test_the_estimate_is_calibrated_on_its_own_errors():
    est = ResponseTimeEstimator()
    est.set_profile(profile(ttft50=100, tpot50=10))
    raw = est.raw_estimate_ms(11, 0, False, 0.0)
    assert raw == est.estimate_ms(11, 0, False, 0.0) == pytest.approx(200)
    for i in range(20):  # observed 1.5x (and up to 1.95x) what the estimate said
        est.observe(0, 150.0, 11, raw * (1.5 + 0.05 * (i % 10)), now=0.0, raw_estimate_ms=raw)
    assert est.median_ratio == pytest.approx(1.75)
    assert est.quantile_ratio(0.9) == pytest.approx(1.95)


def test_stale_own_observations_give_way_to_a_profile_with_data():
    est = ResponseTimeEstimator(stale_after_s=5.0)
    for _ in range(5):
        est.observe(0, 10, 2, 20, now=0.0)
    est.set_profile(profile(ttft50=400, tpot50=40))
    assert est.estimate_ms(2, 0, False, 1.0) == pytest.approx(20)
    assert est.estimate_ms(2, 0, False, 10.0) == pytest.approx(440)


def test_engine_load_adds_what_the_gateway_sent_since_the_profile_was_read():
    t = TargetState("a", healthy=True)
    t.inflight = 2
    t.set_profile(profile(running=5, waiting=1))
    assert t.engine_load() == 6
    t.inflight = 5  # three more sent since the read
    assert t.engine_load() == 9
    t.inflight = 0
    assert t.engine_load() == 4


# ---------------------------------------------------------------------------- latency
def latency_pool():
    targets = states(fast=3.0, mid=2.0, weak=0.5)
    targets["fast"].set_profile(profile(ttft50=50, ttft99=80, tpot50=5, tpot99=8))
    targets["mid"].set_profile(profile(ttft50=100, ttft99=300, tpot50=10, tpot99=30))
    targets["weak"].set_profile(profile(ttft50=200, ttft99=900, tpot50=20, tpot99=60))
    return targets


def test_latency_takes_the_cheapest_target_that_fits_the_sla():
    targets = latency_pool()
    r = route({"strategy": "latency", "targets": ["fast", "mid", "weak"], "explore_rate": 0}, targets)
    # 101 tokens: fast 550 ms, mid 1100 ms, weak 2200 ms
    assert names(r.node.rank(req(101, sla=3000))) == ["weak", "mid", "fast"]
    ranking = r.node.rank(req(101, sla=1500))
    assert (names(ranking), ranking.reason, ranking.estimate_ms) == (["mid", "fast", "weak"], "sla_cheapest", 1100)
    assert names(r.node.rank(req(101, sla=600))) == ["fast", "mid", "weak"]
    ranking = r.node.rank(req(101, sla=100))  # nothing fits: lowest estimate first
    assert (names(ranking), ranking.reason) == (["fast", "mid", "weak"], "lowest_estimate")
    ranking = r.node.rank(req(101))  # no SLA: the cheapest within 2x the best estimate (1100 ms)
    assert (names(ranking), ranking.reason) == (["mid", "fast", "weak"], "cheapest")
    lax = route({"strategy": "latency", "targets": ["fast", "mid", "weak"], "explore_rate": 0,
                 "cheapest_within": 4}, targets)
    assert names(lax.node.rank(req(101))) == ["weak", "mid", "fast"]


def test_sla_free_traffic_spills_before_the_cheapest_targets_queue_grows_without_bound():
    targets = states(fast=3.0, weak=0.5)
    for load in range(8):  # fast: 100 ms + 10 ms per request in flight; weak: 150 ms + 50 ms
        targets["fast"].estimator.observe(load, 100 + 10 * load, 1, 100 + 10 * load, now=1000.0)
        targets["weak"].estimator.observe(load, 150 + 50 * load, 1, 150 + 50 * load, now=1000.0)
    r = route({"strategy": "latency", "targets": ["fast", "weak"], "explore_rate": 0}, targets)
    sent = Counter()
    for _ in range(200):  # none finishes: every one sent stays in flight
        chosen = r.node.rank(req(1)).targets[0]
        chosen.inflight += 1
        sent[chosen.name] += 1
    # weak is taken while within 2x of fast's estimate: 150 + 50 w <= 2 (100 + 10 f)
    assert 20 < sent["weak"] < 60 and sent["fast"] > 140, sent
    weak, fast = (t.estimator.estimate_ms(1, t.inflight - 1, False, 0.0) for t in (targets["weak"], targets["fast"]))
    assert weak <= 2 * fast, (weak, fast)  # its last request was sent within the bound


def test_cheapest_within_is_checked():
    with pytest.raises(ValueError, match=r"cheapest_within must be a number in \[1.0, 1000.0\], got 0.5"):
        route({"strategy": "latency", "targets": ["fast", "weak"], "cheapest_within": 0.5}, states(fast=1.0, weak=0.5))


def test_latency_worst_case_judges_on_p99():
    targets = latency_pool()
    r = route({"strategy": "latency", "targets": ["fast", "mid", "weak"], "explore_rate": 0}, targets)
    # p99: fast 80+800=880, mid 300+3000=3300, weak 900+6000=6900
    assert names(r.node.rank(req(101, sla=3000, worst=False)))[0] == "weak"
    assert names(r.node.rank(req(101, sla=3000, worst=True)))[0] == "fast"


def test_latency_follows_the_live_load():
    targets = latency_pool()
    r = route({"strategy": "latency", "targets": ["fast", "mid", "weak"], "explore_rate": 0}, targets)
    for load in range(8):  # the weak target slows by 100 ms of TTFT per request in flight
        targets["weak"].estimator.observe(load, 200 + 100 * load, 2, 220 + 100 * load, now=1000.0)
    assert names(r.node.rank(req(2, sla=500)))[0] == "weak"
    targets["weak"].inflight = 6
    assert names(r.node.rank(req(2, sla=500)))[0] == "mid"


def test_unhealthy_targets_are_never_ranked():
    targets = latency_pool()
    r = route({"strategy": "latency", "targets": ["fast", "mid", "weak"], "explore_rate": 0}, targets)
    targets["weak"].healthy = False
    assert names(r.node.rank(req(101, sla=3000))) == ["mid", "fast"]
    for t in targets.values():
        t.healthy = False
    assert r.node.rank(req(101)).targets == []


def test_a_target_without_data_is_explored_slowly_and_never_flooded():
    targets = latency_pool()
    targets["new"] = TargetState("new", cost=0.1, healthy=True)
    r = route({"strategy": "latency", "targets": ["fast", "mid", "weak", "new"], "explore_rate": 0.1,
               "max_exploring": 1}, targets, seed=3)
    picks = Counter(r.node.rank(req(101, sla=3000)).targets[0].name for _ in range(2000))
    assert 120 < picks["new"] < 290, picks  # about 10 %, although it is the cheapest
    assert picks["weak"] > 1600
    targets["new"].exploring = 1  # one learning request open: no more until it finishes
    assert all(r.node.rank(req(101, sla=3000)).targets[0].name != "new" for _ in range(500))
    assert names(r.node.rank(req(101, sla=3000)))[-1] == "new"


def test_with_no_data_anywhere_the_least_loaded_goes_first():
    targets = states(a=1.0, b=1.0, c=0.5)
    targets["a"].inflight, targets["b"].inflight, targets["c"].inflight = 2, 0, 1
    ranking = route({"strategy": "latency", "targets": ["a", "b", "c"]}, targets).node.rank(req())
    assert (names(ranking), ranking.reason, ranking.explore) == (["b", "c", "a"], "no_data_least_loaded", True)


# ---------------------------------------------------------------------------- other strategies
def test_loadbalance_follows_the_weights_and_ranks_the_rest_after():
    targets = states(a=1, b=1, c=1)
    r = route({"strategy": "loadbalance", "targets": [{"target": "a", "weight": 6}, {"target": "b", "weight": 3},
                                                      {"target": "c", "weight": 1}]}, targets, seed=1)
    firsts = Counter()
    for _ in range(5000):
        ranking = r.node.rank(req())
        assert sorted(names(ranking)) == ["a", "b", "c"]
        firsts[ranking.targets[0].name] += 1
    assert firsts["a"] == pytest.approx(3000, rel=0.06)
    assert firsts["b"] == pytest.approx(1500, rel=0.1)
    assert firsts["c"] == pytest.approx(500, rel=0.15)
    targets["a"].healthy = False
    assert all(r.node.rank(req()).targets[0].name != "a" for _ in range(200))


def test_fallback_keeps_the_order_and_skips_unhealthy_children():
    targets = states(a=1, b=1, c=1, d=1)
    spec = {"strategy": "fallback", "targets": ["a", {"strategy": "loadbalance", "targets": ["b", "c"]}, "d"]}
    r = route(spec, targets)
    assert r.retry_codes == RETRY_FALLBACK
    ranking = r.node.rank(req())
    assert names(ranking)[0] == "a" and names(ranking)[-1] == "d" and ranking.reason == "primary"
    targets["a"].healthy = False
    ranking = r.node.rank(req())
    assert sorted(names(ranking)[:2]) == ["b", "c"] and ranking.reason == "fallback_unhealthy"
    assert route("a", targets).retry_codes == RETRY_ALWAYS


def test_conditional_rules_pick_the_branch():
    targets = states(big=1, small=1, eu=1)
    spec = {"strategy": "conditional", "conditions": [
        {"query": {"metadata.tier": {"$eq": "gold"}}, "then": "big"},
        {"query": {"$and": [{"params.max_tokens": {"$gt": 100}}, {"metadata.region": {"$in": ["eu", "ch"]}}]},
         "then": "eu"},
        {"query": {"$or": [{"params.temperature": {"$lt": 0.1}}, {"metadata.team": {"$ne": "x"}}]}, "then": "small"},
    ], "default": "big"}
    r = route(spec, targets)

    def pick(params=None, metadata=None):
        ranking = r.node.rank(req(params=params, metadata=metadata))
        return names(ranking)[0], ranking.reason

    assert pick(metadata={"tier": "gold"}) == ("big", "condition_0")
    assert pick({"max_tokens": 200}, {"region": "ch", "team": "x"}) == ("eu", "condition_1")
    assert pick({"max_tokens": 50}, {"region": "ch", "team": "x"}) == ("big", "default")
    assert pick({"temperature": 0.0}, {"team": "x"}) == ("small", "condition_2")
    assert pick({}, {}) == ("small", "condition_2")  # a missing team is $ne "x"
    assert pick({"temperature": "cold"}, {"team": "x"}) == ("big", "default")  # $lt compares numbers only


def test_conditional_without_a_match_or_default_ranks_nothing():
    r = route({"strategy": "conditional", "conditions": [{"query": {"metadata.a": 1}, "then": "x"}]}, states(x=1))
    ranking = r.node.rank(req(metadata={"a": 2}))
    assert (ranking.targets, ranking.reason) == ([], "no_condition_matched")


@pytest.mark.parametrize("rule, message", [
    ({"metadata.a": {"$gt": "z"}}, "$gt needs a number"),
    ({"metadata.a": {"$in": 3}}, "$in needs a list"),
    ({"metadata.a": {"$regex": "x"}}, "unknown operator '$regex'"),
    ({"body.a": 1}, "field 'body.a' must be params.<name>"),
    ({"$and": []}, "$and needs a non-empty list"),
    ({"$not": {}}, "'$not' is not a rule operator"),
])
def test_bad_rules_are_refused_naming_where(rule, message):
    with pytest.raises(ValueError, match=message.replace("$", r"\$").replace("(", r"\(")) as info:
        compile_query(rule, "models.m.route.conditions[0].query")
    assert "models.m.route.conditions[0].query" in str(info.value)


def test_prefix_affinity_keeps_a_shared_system_prompt_on_one_replica_within_the_load_bound():
    targets = states(r0=1, r1=1, r2=1, r3=1)
    r = route({"strategy": "prefix-affinity", "targets": ["r0", "r1", "r2", "r3"], "prefix_chars": 128,
               "block_chars": 64, "load_factor": 1.5}, targets)
    system = "You are a helpful assistant. " * 5  # 145 chars: two whole blocks
    home = names(r.node.rank(req(prefix=system + "What is 2+2?")))[0]
    assert all(names(r.node.rank(req(prefix=system + f"question {i}")))[0] == home for i in range(50))
    # Different system prompts spread over the replicas.
    homes = {names(r.node.rank(req(prefix=f"System prompt number {i}. " * 6)))[0] for i in range(40)}
    assert len(homes) == 4
    # The home replica busier than 1.5x the mean: the next in its order takes it.
    targets[home].inflight = 6
    ranking = r.node.rank(req(prefix=system + "x"))
    assert names(ranking)[0] != home and ranking.reason == "affinity_overflow"
    assert prefix_key("short", 128, 64) is None
    assert prefix_key("a" * 64 + "b", 128, 64) == prefix_key("a" * 64 + "c", 128, 64)


def test_prefix_affinity_losing_a_replica_moves_only_its_keys():
    targets = states(r0=1, r1=1, r2=1)
    r = route({"strategy": "prefix-affinity", "targets": ["r0", "r1", "r2"], "load_factor": 100}, targets)
    prompts = [f"Prompt family {i}: " * 20 for i in range(60)]
    before = {p: names(r.node.rank(req(prefix=p)))[0] for p in prompts}
    targets["r1"].healthy = False
    after = {p: names(r.node.rank(req(prefix=p)))[0] for p in prompts}
    assert all(after[p] == before[p] for p in prompts if before[p] != "r1")
    assert all(after[p] != "r1" for p in prompts)


# ---------------------------------------------------------------------------- the routes file
def test_routes_file_checks_name_the_path():
    good = {"targets": [{"name": "a", "address": "127.0.0.1:1"}], "models": {"m": "a"}}
    assert parse_routes(good).default_model == "m"
    cases = [
        ({"targets": [], "models": {"m": "a"}}, "targets must be a non-empty list"),
        ({"targets": [{"name": "a", "address": "nowhere"}], "models": {"m": "a"}}, r"targets\[0\].address"),
        ({"targets": [{"name": "a", "address": "h:1", "cost": -1}], "models": {"m": "a"}}, r"targets\[0\].cost"),
        ({**good, "default_model": "zz"}, "default_model 'zz'"),
        ({**good, "models": {"m": {"route": "a", "sla_ms": 0}}}, "models.m.sla_ms"),
        ({**good, "models": {"m": {"route": "a", "sla_percentile": 90}}}, "sla_percentile must be 50 or 99"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            parse_routes(data)


@pytest.mark.parametrize("spec, message", [
    ("nope", "models.m.route: unknown target 'nope'"),
    ({"strategy": "magic", "targets": ["a"]}, "strategy must be one of"),
    ({"strategy": "latency", "targets": [{"strategy": "fallback", "targets": ["a"]}]}, "latency takes target names"),
    ({"strategy": "loadbalance", "targets": [{"target": "a", "weight": 0}]}, "at least one weight must be > 0"),
    ({"strategy": "fallback", "targets": ["a"], "retries": 3}, r"unknown fields \['retries'\]"),
    ({"strategy": "latency", "targets": ["a"], "explore_rate": 2}, r"explore_rate must be a number in \[0.0, 1.0\]"),
    ({"strategy": "conditional", "conditions": [{"query": {"metadata.a": 1}}]}, "exactly query and then"),
])
def test_bad_route_nodes_are_refused_naming_the_path(spec, message):
    with pytest.raises(ValueError, match=message):
        route(spec, states(a=1))


def test_portkey_spelling_of_the_strategy_is_accepted():
    r = route({"strategy": {"mode": "fallback"}, "targets": ["a", "b"]}, states(a=1, b=1))
    assert names(r.node.rank(req())) == ["a", "b"]


def test_the_readme_routes_example_loads(tmp_path, monkeypatch):
    import re as _re
    from pathlib import Path as _Path

    from services.gateway.config import GatewayServiceConfig

    repo = _Path(__file__).resolve().parents[2]
    readme = (repo / "docs" / "gateway.md").read_text()  # the README's gateway section, moved
    section = readme[readme.index("## Gateway"):]
    example = _re.search(r"```yaml\n(.*?)```", section, _re.S).group(1)
    (tmp_path / "routes.yaml").write_text(example)
    # The example's tokenizer path is relative to the routes file, as if it sat in the repository
    # root; the gateway refuses to start on a tokenizer it cannot load.
    (tmp_path / "models").symlink_to(repo / "models")
    monkeypatch.setenv("FAR_TOKEN", "secret")
    GatewayServiceConfig(config=str(tmp_path / "routes.yaml")).validate()
