"""The GGUF file llama.cpp runs, checked against the checksum committed beside it.

``benchmarks/models/stories260K.gguf`` holds the same weights as ``models/stories260K``
(benchmarks/models/README.md has the provenance); ``SHA256SUMS`` there names its sha256.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
DEFAULT_GGUF = MODELS_DIR / "stories260K.gguf"


class ChecksumError(ValueError):
    """The file is missing, unlisted, or its bytes are not the ones its checksum names."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def parse_sha256sums(text: str) -> dict[str, str]:
    """``sha256sum`` output ("HEX  NAME" per line; "*NAME" in binary mode) → {name: hex}."""
    sums = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        digest, sep, name = line.partition(" ")
        name = name.lstrip(" ").removeprefix("*")
        if not sep or not name or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise ChecksumError(f"SHA256SUMS line {number} is not 'HEX  NAME': {line!r}")
        sums[name] = digest.lower()
    return sums


def expected_sha256(path: Path) -> str:
    """The checksum listed for ``path`` in the SHA256SUMS of its folder."""
    sums_file = path.parent / "SHA256SUMS"
    if not sums_file.is_file():
        raise ChecksumError(f"no SHA256SUMS beside {path}")
    sums = parse_sha256sums(sums_file.read_text())
    if path.name not in sums:
        raise ChecksumError(f"{sums_file} lists no checksum for {path.name}")
    return sums[path.name]


def verified_gguf(path: Path = DEFAULT_GGUF, expected: str | None = None) -> Path:
    """``path`` when its sha256 is ``expected`` (default: its SHA256SUMS entry); ChecksumError otherwise."""
    if not path.is_file():
        raise ChecksumError(f"{path} does not exist")
    want = (expected or expected_sha256(path)).lower()
    got = sha256_of(path)
    if got != want:
        raise ChecksumError(f"{path}: sha256 is {got}, expected {want}; not the file "
                            "the benchmark documents (benchmarks/models/README.md)")
    return path
