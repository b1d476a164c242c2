"""Which forward paths a model runner set up, for tests that reach a path's machinery."""

from __future__ import annotations

from services.executor.forward_paths import ForwardPath
from services.executor.model_runner import ModelRunner


def forward_path(runner: ModelRunner, name: str) -> ForwardPath | None:
    """The runner's forward path called ``name``, or None where it is not set up."""
    return next((path for path in runner.paths if path.name == name), None)


def decode_graphs(runner: ModelRunner):
    """The decode graphs' buffers (services/runtime/model/decode_graphs.py), or None."""
    path = forward_path(runner, "decode_graphs")
    return None if path is None else path.graphs


def fused_decode(runner: ModelRunner):
    """The fused CPU step (services/runtime/model/fused_decode.py), or None."""
    path = forward_path(runner, "fused_decode")
    return None if path is None else path.fused
