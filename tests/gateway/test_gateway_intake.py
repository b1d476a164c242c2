"""The gateway's one intake (services/gateway/intake.py): a Generate call and an HTTP body become the
same routing request, every prompt's prefix is cut at the one constant, and OpenAI's two names of
the output limit resolve one way."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.common.pb.tokenmill.v1 import generation_pb2
from services.gateway import intake
from services.gateway.grpc_servicer import routed
from services.gateway.intake import max_output_tokens, route_request
from services.gateway.routing.build import RETRY_ALWAYS, Route
from services.gateway.routing.node import TargetNode
from services.gateway.routing.target import TargetState

ROUTE = Route("chat", TargetNode(TargetState("t")), 2000.0, False, 256, RETRY_ALWAYS, "")


def test_a_grpc_call_and_its_headers_become_the_routing_request():
    request = generation_pb2.GenerateRequest(text="Once upon a time", priority=3)
    request.stop.max_tokens = 40
    request.sampling.temperature = 0.5
    md = {"x-tokenmill-sla-ms": "900", "x-tokenmill-sla-percentile": "99", "x-tokenmill-metadata": '{"tier": "gold"}'}
    rr = routed(ROUTE, request, md)
    assert (rr.model, rr.expected_output_tokens, rr.sla_ms, rr.worst_case, rr.prefix) == (
        "chat", 40, 900.0, True, "Once upon a time")
    assert dict(rr.params) == {"max_tokens": 40, "priority": 3, "top_k": 0, "temperature": 0.5}
    assert rr.metadata == {"tier": "gold"} and rr.budget is None
    same = route_request(ROUTE, md, max_tokens=40, prefix="Once upon a time", params=rr.params)
    assert same == rr
    bare = routed(ROUTE, generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6])), {})
    assert (bare.expected_output_tokens, bare.sla_ms, bare.prefix) == (256, 2000.0, "5,6")  # the route's defaults
    with pytest.raises(InvalidArgumentError, match="x-tokenmill-sla-ms"):
        routed(ROUTE, request, {"x-tokenmill-sla-ms": "soon"})


def test_every_prompt_form_is_cut_at_the_one_constant(monkeypatch):
    monkeypatch.setattr(intake, "MAX_PREFIX_CHARS", 8)
    text = routed(ROUTE, generation_pb2.GenerateRequest(text="abcdefghijklmnop"), {})
    chat = generation_pb2.GenerateRequest()
    chat.chat.messages.add(role="user", content="abcdefghijklmnop")
    assert text.prefix == "abcdefgh"
    assert routed(ROUTE, chat, {}).prefix == "<user>ab"
    assert intake.text_prefix("abcdefghijklmnop") == "abcdefgh"
    assert len(intake.ids_prefix(list(range(100)))) <= 8


def test_max_completion_tokens_wins_over_max_tokens():
    assert max_output_tokens(7, 100) == 7
    assert max_output_tokens(None, 100) == 100
    assert max_output_tokens(None, None) is None
