"""tokenmill's benchmarks: one harness (benchmarks/harness/) and the runs built on it.

Run from a checkout's root: ``python -m benchmarks NAME [FLAGS]`` (``python -m benchmarks``
lists the runs; ``python -m benchmarks NAME --help`` their flags). The benchmarks are not
part of the installed package: they need the checkout's models, data and results folder.
"""
