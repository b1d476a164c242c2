"""``tokenmill convert FORMAT ...``: turn a checkpoint into tokenmill's model directory format.

    tokenmill convert llama2c --checkpoint X.bin --tokenizer tok.bin --out DIR
    tokenmill convert gguf FILE --out DIR [--weights fp32|bf16|keep]      (or --package DIST instead of FILE)
"""

from __future__ import annotations

import sys

FORMATS = {"llama2c": "services.tools.llama2c", "gguf": "services.tools.gguf"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in FORMATS:
        print(f"usage: tokenmill convert {{{','.join(FORMATS)}}} [ARGS...]", file=sys.stderr)
        return 2
    import importlib

    return int(importlib.import_module(FORMATS[argv[0]]).main(argv[1:]) or 0)
