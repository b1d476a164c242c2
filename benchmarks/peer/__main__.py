"""``python -m benchmarks.peer``: tokenmill against llama.cpp (``make bench-peer``)."""

import sys

from benchmarks.peer.driver import main

sys.exit(main())
