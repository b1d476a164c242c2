"""The rendered overlays, once per test session (``kubectl kustomize``; a missing kubectl fails
with what to install, never a skip)."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import OVERLAYS, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}
