"""Every connection of a tensor-parallel group proves the launch's secret before any step runs.

The ranks meet at a file store only the executor's user reaches (leader.py), but gloo's pairs
then connect over loopback TCP to ports each rank listens on, and gloo takes no credentials: a
local process that finds such a port (a scan needs no store) and connects first, with the
pair's small sequence number, holds the connection in the peer's place and could feed the
group's sums or read the step inputs. So, once a group is formed, each rank sends every other
rank, over that very connection, HMAC-SHA256(secret, group | sender | receiver), and checks the
tag each peer sent it. An impostor on a connection cannot make the tag: the secret is made per
launch by rank 0 and reaches the other ranks through their stdin pipe (never a file, the store
or a command line, which every local user can read in /proc), and the genuine peer's tag for
that connection went to the impostor's place, not to it. A failed check ends the start with
RuntimeError naming the group and the rank: the group is not used.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

import torch
import torch.distributed as dist

SECRET_BYTES = 32
TAG_BYTES = 32
AUTH_TIMEOUT = timedelta(seconds=120)
"""How long a rank waits for a peer's tag (a peer loading slowly has already joined the group)."""
_TAG = 0x7A11


def new_secret() -> bytes:
    """A launch's secret, made by rank 0."""
    return secrets.token_bytes(SECRET_BYTES)


def pair_tag(secret: bytes, group: str, sender: int, receiver: int) -> bytes:
    return hmac.new(secret, f"{group}|{sender}->{receiver}".encode(), hashlib.sha256).digest()


def authenticate(pg: dist.ProcessGroup, group: str, rank: int, world: int, secret: bytes,
                 timeout: timedelta = AUTH_TIMEOUT) -> None:
    """Send each peer this rank's tag and check each peer's (all sends and receives posted at
    once: no order to deadlock on). RuntimeError when a peer's tag is wrong or never comes."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"the tensor-parallel secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    peers = [r for r in range(world) if r != rank]
    sent = {r: torch.frombuffer(bytearray(pair_tag(secret, group, rank, r)), dtype=torch.uint8) for r in peers}
    got = {r: torch.zeros(TAG_BYTES, dtype=torch.uint8) for r in peers}
    works = [pg.send([sent[r]], r, _TAG) for r in peers] + [pg.recv([got[r]], r, _TAG) for r in peers]
    for work in works:
        try:
            work.wait(timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"tensor-parallel {group} group, rank {rank}: a peer sent no proof of the launch's "
                               f"secret ({exc})") from None
    for r in peers:
        if not hmac.compare_digest(bytes(got[r].tolist()), pair_tag(secret, group, r, rank)):
            raise RuntimeError(f"tensor-parallel {group} group, rank {rank}: the connection of rank {r} did not "
                               "prove the launch's secret (a process other than the executor's own rank holds "
                               "it); the group is not used")
