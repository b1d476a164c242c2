"""Where an adapter loaded while serving may lie: inside the directory --lora-dir names.

The Admin API (the scheduler's LoadAdapter, the gateway's /v1/load_lora_adapter) makes
executors read files from a path a caller names; without a bound any caller holding the
engine's secret could have them read any file the process can. Start-time --lora NAME=PATH is
the operator's own choice and is not checked here.

Both the scheduler (the trust boundary) and the executor (defence in depth, and the side whose
filesystem the adapter is on) resolve the path: a relative one inside the directory, every
symlink followed, and refuse a result outside it (``..``, an absolute path elsewhere, a link
pointing out).
"""

from __future__ import annotations

import os

from services.common.errors import FailedPreconditionError, InvalidArgumentError

LORA_DIR_UNSET = ("path: loading adapters while serving is off: start the scheduler and the executors with "
                  "--lora-dir (TOKENMILL_LORA_DIR) naming the directory adapters may be loaded from "
                  "(--lora NAME=PATH at start needs none)")


def resolve_in_lora_dir(lora_dir: str, path: str) -> str:
    """``path`` resolved inside ``lora_dir`` (FailedPreconditionError when no directory is
    configured, InvalidArgumentError naming the field when it resolves outside it)."""
    if not lora_dir:
        raise FailedPreconditionError(LORA_DIR_UNSET)
    root = os.path.realpath(lora_dir)
    resolved = os.path.realpath(os.path.join(root, path))
    if resolved == root or os.path.commonpath([root, resolved]) != root:
        raise InvalidArgumentError(f"path: {path[:200]!r} resolves to {resolved[:300]!r}, outside the adapter "
                                   f"directory --lora-dir={root} (adapters load only from its subdirectories; "
                                   f"symlinks and .. are followed before the check)")
    return resolved
