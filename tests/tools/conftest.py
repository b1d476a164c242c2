"""Fixtures of the conversion tests: SmolLM2-135M-Instruct converted from its PyPI package."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools.smollm2 import converted_dir, packaged_file


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return packaged_file()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    return converted_dir(tmp_path_factory)
