"""The forward-path registry: which path the flags, device and backend choose, each path's
settings as a field of the executor's config, and a config that loads no torch."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest

from services.executor.config import ExecutorConfig
from services.executor.forward_paths import FORWARD_PATHS, Placement, choose_path
from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.executor.forward_paths.eager import EagerPath
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from tests.conftest import REPO_ROOT

CPU = Placement("cpu", "cpu")
COMPILE = CompiledDecodeSettings(compile=True)
PADDED = DecodeGraphSettings(padded_decode_on_cpu=True)


@pytest.mark.parametrize("placement,settings,chosen", [
    (CPU, {}, "fused_decode"),
    (Placement("cpu", "torch"), {}, "fused_decode"),  # wanted; it declines the model once loaded
    (CPU, {"fused_decode": FusedDecodeSettings(cpu_decode="eager")}, "eager"),
    (CPU, {"compiled_decode": COMPILE}, "compiled_decode"),
    (CPU, {"decode_graphs": PADDED}, "decode_graphs"),
    (CPU, {"decode_graphs": PADDED, "compiled_decode": COMPILE}, "compiled_decode"),
    (Placement("cuda", "triton"), {}, "decode_graphs"),
    (Placement("cuda", "triton"), {"decode_graphs": DecodeGraphSettings(enforce_eager=True)}, "eager"),
    (Placement("cuda", "torch"), {}, "eager"),
    (Placement("cuda", "triton"), {"decode_graphs": PADDED, "fused_decode": FusedDecodeSettings("fused")},
     "decode_graphs"),
])
def test_the_first_wanted_path_in_priority_order_is_chosen(placement, settings, chosen):
    assert choose_path(ExecutorConfig(**settings).path_settings(), placement).name == chosen


def test_every_path_with_settings_is_a_field_of_the_config_and_eager_comes_last():
    config_fields = {f.name: f for f in fields(ExecutorConfig)}
    handed = ExecutorConfig().path_settings()
    assert set(handed) == {path.name for path in FORWARD_PATHS if path.settings is not None}
    for path in FORWARD_PATHS:
        if path.settings is not None:
            assert isinstance(getattr(ExecutorConfig(), path.name), path.settings)
            assert handed[path.name] is not None and isinstance(handed[path.name], path.settings)
            assert config_fields[path.name].metadata["env_prefix"] == "TOKENMILL_EXECUTOR_"
    # Composed, not generated: the config names each path's settings itself and inherits nothing.
    assert ExecutorConfig.__mro__[1:] == (object,)
    assert [f.name for f in fields(ExecutorConfig) if f.metadata.get("embedded")] == \
        [path.name for path in FORWARD_PATHS if path.settings is not None]
    assert FORWARD_PATHS[-1] is EagerPath
    assert len({path.name for path in FORWARD_PATHS}) == len(FORWARD_PATHS)


def test_each_path_validates_its_own_settings_and_the_config_what_they_need_of_the_rest():
    with pytest.raises(ValueError, match="cpu_fused_max_tokens must be >= 0"):
        FusedDecodeSettings(cpu_fused_max_tokens=-1).validate()
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size must be >= 1, got 0"):
        ExecutorConfig(decode_graphs=DecodeGraphSettings(cuda_graph_max_batch_size=0)).validate()
    with pytest.raises(ValueError, match="compile runs on the CPU with the cpu attention backend; got device 'cuda'"):
        ExecutorConfig(device="cuda", compiled_decode=COMPILE).validate()
    with pytest.raises(ValueError, match="cpu_decode 'fused' runs on the CPU without compile; got device 'cuda'"):
        ExecutorConfig(device="cuda", fused_decode=FusedDecodeSettings(cpu_decode="fused")).validate()


def test_the_config_and_the_registry_import_no_torch():
    code = ("import sys, services.executor.config, services.executor.forward_paths; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
