"""``tokenmill convert llama2c --checkpoint X.bin --tokenizer tok.bin --out DIR``."""

from __future__ import annotations

import sys

FORMATS = {"llama2c": "services.tools.llama2c"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in FORMATS:
        print(f"usage: tokenmill convert {{{','.join(FORMATS)}}} [ARGS...]", file=sys.stderr)
        return 2
    import importlib

    return int(importlib.import_module(FORMATS[argv[0]]).main(argv[1:]) or 0)
