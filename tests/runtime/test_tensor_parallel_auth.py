"""A process that holds a tensor-parallel group's gloo connection in a rank's place without the
launch's secret is refused before the group is used: rank 0, running the executor's own join,
meets a foreign process at the rendezvous (as one that won gloo's connect race on loopback
would) which speaks the proof's protocol with a secret of its own; the join ends with an error
naming that rank. The genuine ranks (tests/executor/test_tensor_parallel.py) pass the same check
with the secret rank 0 wrote on their stdin, which is on no command line."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from services.runtime.parallel.collectives import RankGroups
from services.runtime.parallel.leader import open_store
from services.runtime.parallel.pair_auth import new_secret
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

IMPOSTOR = """
import sys, torch
from services.runtime.parallel.collectives import RankGroups
from services.runtime.parallel.leader import open_store
store = open_store(sys.argv[1], 2)
try:
    RankGroups.join(store, 1, 2, torch.device("cpu"), "gloo", secret=bytes(range(32)))
except RuntimeError as exc:
    print("impostor refused too:", exc)
"""


def test_a_foreign_process_in_a_ranks_place_cannot_join_the_group(tmp_path):
    store_path = str(tmp_path / "store")
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, store_path], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outcome: dict[str, BaseException | RankGroups] = {}

    def rank_zero() -> None:
        try:
            outcome["groups"] = RankGroups.join(open_store(store_path, 2), 0, 2, torch.device("cpu"), "gloo",
                                                secret=new_secret())
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=rank_zero, daemon=True)
    thread.start()
    thread.join(150)
    output = impostor.communicate(timeout=60)[0]
    assert not thread.is_alive(), "rank 0's join neither refused nor accepted the impostor"
    assert "groups" not in outcome, f"rank 0 formed a group with a process that lacks the secret: {output}"
    error = outcome["error"]
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("tensor-parallel step group, rank 0: the connection of rank 1 did not prove the "
                                 "launch's secret"), error


def test_genuine_ranks_with_the_launchs_secret_join(tmp_path):
    """The same rendezvous with the secret shared: both groups form and sum."""
    store_path, secret = str(tmp_path / "store"), new_secret()
    groups: dict[int, RankGroups] = {}

    def rank(r: int) -> None:
        groups[r] = RankGroups.join(open_store(store_path, 2), r, 2, torch.device("cpu"), "gloo", secret=secret)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(groups) == [0, 1]
    sums = [torch.full((3,), float(r + 1)) for r in (0, 1)]
    works = [threading.Thread(target=groups[r].all_reduce, args=(sums[r],)) for r in (0, 1)]
    for w in works:
        w.start()
    for w in works:
        w.join(60)
    assert all(torch.equal(s, torch.full((3,), 3.0)) for s in sums)
