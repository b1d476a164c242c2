"""The drafts of a drafter reply, by sequence."""

from __future__ import annotations

from services.common.pb.tokenmill.v1 import drafter_pb2


def drafts_of(reply: drafter_pb2.ProposeResponse) -> dict[int, list[int]]:
    drafts, offset = {}, 0
    for seq_id, count in zip(reply.seq_ids, reply.draft_counts):
        drafts[seq_id] = list(reply.draft_token_ids[offset : offset + count])
        offset += count
    assert offset == len(reply.draft_token_ids)
    return drafts
