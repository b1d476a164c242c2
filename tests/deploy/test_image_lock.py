"""requirements-image.lock, which the CPU image installs with ``pip install --require-hashes``:
every pin of requirements.txt at its version (torch as its ``+cpu`` build), every entry one exact
version and a sha256, and nothing pinned twice."""

from __future__ import annotations

import re

from tests.deploy.manifests import REPO_ROOT

ENTRY = re.compile(r"^([a-z0-9][a-z0-9._-]*)==(\S+) \\\n    --hash=sha256:([0-9a-f]{64})$", re.MULTILINE)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.txt: {line!r} is not pinned with =="
            out[_canonical(name)] = version
    return out


def test_the_lock_covers_every_pin_of_requirements_txt_with_a_hash():
    text = (REPO_ROOT / "requirements-image.lock").read_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#")) + "\n"
    entries = ENTRY.findall(body)
    assert len(entries) == body.count("==") == body.count("--hash=sha256:"), "an entry without exactly one hash"
    locked: dict[str, str] = {}
    for name, version, _ in entries:
        assert _canonical(name) not in locked, f"{name} locked twice"
        locked[_canonical(name)] = version
    for name, version in pins((REPO_ROOT / "requirements.txt").read_text()).items():
        assert name in locked, f"{name} is pinned in requirements.txt but not in requirements-image.lock"
        want = f"{version}+cpu" if name == "torch" else version
        assert locked[name] == want, f"{name}: requirements.txt pins {version}, the lock has {locked[name]}; " \
                                     "run scripts/lock_image_requirements.py"
    assert len(locked) > len(pins((REPO_ROOT / "requirements.txt").read_text()))  # the dependencies too
