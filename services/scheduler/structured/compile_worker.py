"""A grammar compile worker: ``python -m services.scheduler.structured.compile_worker [TOKENIZER_JSON]``.

Reads one JSON line per job on stdin ({"kind", "spec", "options"}) and answers one JSON line on
stdout ({"grammar": ...} or {"error": ...}), in order. Started and fed by compile_workers.py.

The work runs on a thread whose native stack is ``COMPILE_STACK_BYTES``, a quarter of the 8 MiB
a thread gets by default: llguidance recurses over a grammar's rules in native code, and a
grammar deep enough to overflow that stack kills this process (SIGSEGV), not the scheduler;
one that compiles here has four times the stack left where the executor builds its matcher.
No core file is written for such a crash.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading

COMPILE_STACK_BYTES = 2 * 1024 * 1024


def main(argv: list[str]) -> int:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to the log, never into the replies
    threading.stack_size(COMPILE_STACK_BYTES)

    import llguidance

    from services.common.errors import InvalidArgumentError
    from services.scheduler.structured.grammar_build import build, byte_vocabulary
    from services.scheduler.structured.structured_output import StructuredKind, StructuredOutput

    vocabulary = llguidance.LLTokenizer(argv[0]) if argv else byte_vocabulary()
    for line in sys.stdin.buffer:
        job = json.loads(line)
        request = StructuredOutput(StructuredKind(job["kind"]), job["spec"], tuple(job["options"]))
        reply: dict[str, str] = {}

        def run() -> None:
            try:
                reply["grammar"] = build(request, vocabulary)  # noqa: B023 - joined before the next job
            except InvalidArgumentError as exc:
                reply["error"] = str(exc)  # noqa: B023
            except Exception as exc:  # noqa: BLE001 - the library's own failure is this request's
                reply["error"] = f"{request.field} does not compile: {type(exc).__name__}: {exc}"  # noqa: B023

        thread = threading.Thread(target=run, name="grammar-compile")
        thread.start()
        thread.join()
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
