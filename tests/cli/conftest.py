"""Fixtures of the command-line tests: SmolLM2-135M-Instruct, converted once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools.smollm2 import converted_dir


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    return converted_dir(tmp_path_factory)
