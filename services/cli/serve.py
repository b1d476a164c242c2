"""``tokenmill serve SERVICE [FLAGS...]``: run one service in the foreground.

Each service's flags and environment variables come from its config dataclass; see
``tokenmill serve SERVICE --help``. Modules are imported only for the chosen service, so the
tokenizer never pays for torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# service -> module whose main(argv) runs it.
SERVICES: dict[str, str] = {
    "tokenizer": "services.tokenizer.main",
    "executor": "services.executor.main",
    "drafter": "services.drafter.main",
    "scheduler": "services.scheduler.main",
    "gateway": "services.gateway.main",
}


def usage() -> str:
    return (
        "usage: tokenmill serve {" + ",".join(SERVICES) + "} [FLAGS...]\n\n"
        "Run `tokenmill serve SERVICE --help` for the service's flags and environment variables."
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    service, rest = argv[0], argv[1:]
    if service not in SERVICES:
        print(f"tokenmill serve: unknown service {service!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SERVICES[service])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
