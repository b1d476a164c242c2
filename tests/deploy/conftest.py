"""The rendered overlays, once per test session (``kubectl kustomize``; a missing kubectl fails
with what to install, never a skip)."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import VARIANTS, render_variant


@pytest.fixture(scope="session")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Every overlay, and the overlays with opt-in components (VARIANTS)."""
    workdir = tmp_path_factory.mktemp("kustomize")
    return {name: render_variant(name, workdir) for name in VARIANTS}
