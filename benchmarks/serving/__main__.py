"""``python -m benchmarks.serving``: the serving benchmark (``tokenmill bench`` runs the same driver)."""

import sys

from benchmarks.serving.driver import main

sys.exit(main())
