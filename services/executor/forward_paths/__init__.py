"""The registry of the executor's forward paths, in priority order.

A forward path is one way to run the model over a step (base.py says what a path provides).
The first path in ``FORWARD_PATHS`` whose flags, device and attention backend want it is the
executor's; once the model is loaded it is set up over it (or declines, when the model does not
suit it), and every step goes to it if it ``takes`` the step, else to eager, the last path,
which takes every step. One path besides eager, because each changes how the whole executor
runs: the compiled step needs plain weights, the decode graphs a scratch KV block and the
graphs' memory, and the fused step's LM head serves every step.

Adding a path is one file here, a class of ``ForwardPath`` with its settings dataclass, and
its place in ``FORWARD_PATHS``, and its settings a field of ExecutorConfig named for it
(services/executor/config.py), so its flags, TOKENMILL_EXECUTOR_* variables and help exist on
every command line built from the config; ExecutorConfig.validate calls the settings'
``validate`` and holds what the path's flags require of the device or of another path. Each
path is handed only its own settings (``ExecutorConfig.path_settings``) and its placement.

The policy (flags, which steps, warm-up) is here because it is the executor's; the torch code
each path runs (services/runtime/model/compiled_decode.py, decode_graphs.py, fused_decode.py)
is model runtime beside the model it runs, which the drafter's draft model shares. Nothing
here imports torch until a path is set up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.executor.forward_paths.base import ForwardPath, PathRuntime, Placement
from services.executor.forward_paths.compiled_decode import CompiledDecodePath
from services.executor.forward_paths.decode_graphs import DecodeGraphsPath
from services.executor.forward_paths.eager import EagerPath
from services.executor.forward_paths.fused_decode import FusedDecodePath

FORWARD_PATHS: tuple[type[ForwardPath], ...] = (CompiledDecodePath, DecodeGraphsPath, FusedDecodePath, EagerPath)
"""In priority order. The compiled step and the decode graphs never meet (the first runs on a
CPU, the second on CUDA or, padded, on a CPU without ``--compile``); the fused step defers to
both, as before them it did."""


def choose_path(settings: Mapping[str, Any], placement: Placement) -> type[ForwardPath]:
    """The first path that its settings (``settings[path.name]``), the device and the attention
    backend want (eager at the latest)."""
    return next(path for path in FORWARD_PATHS if path.wanted(settings.get(path.name), placement))


def set_up_paths(chosen: type[ForwardPath], settings: Mapping[str, Any],
                 runtime: PathRuntime) -> tuple[ForwardPath, ...]:
    """The paths each step is offered to, in order: the chosen one, where it takes the model,
    then eager."""
    paths = []
    if chosen is not EagerPath:
        path = chosen.set_up(settings.get(chosen.name), runtime)
        if path is not None:
            paths.append(path)
    paths.append(EagerPath.set_up(None, runtime))
    return tuple(paths)


__all__ = ["FORWARD_PATHS", "ForwardPath", "PathRuntime", "Placement", "choose_path", "set_up_paths"]
