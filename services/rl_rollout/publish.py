"""Trajectory groups onto the run's Redis stream: one XADD per complete group, so a reader never sees half a group and
a worker that dies loses only the groups it had not finished. A publish is idempotent: the client retries a command
that finds Redis gone (services/common/registry.py), and a Redis that died after adding the group but before replying
comes back with it (its append-only file), so the XADD runs in a script that first looks up the publish's own token
and adds nothing the second time."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from proto import rollout_pb2 as pb
from services.common import rollout_stream
from services.common.registry import connect
from services.rl_rollout.engine import Completion


def stream_key(run: str) -> str:
    return f"foldmoe:{run}:rl:trajectories"


def encode_group(group_id: str, worker: str, version: int, task: str, prompt: str, meta: dict[str, Any],
                 temperature: float, completions: list[Completion], rewards: list[float], prompt_seq: int = 0,
                 prompt_records: int = 0) -> pb.TrajectoryGroup:
    first = completions[0]
    group = pb.TrajectoryGroup(
        group_id=group_id, worker=worker, policy_version=version, task=task, prompt=prompt,
        prompt_tokens=first.prompt_tokens, meta_json=json.dumps(meta), temperature=temperature,
        moe_layers=first.routing.shape[0], top_k=first.routing.shape[2] if first.routing.ndim == 3 else 0,
        created_unix=time.time(), prompt_seq=prompt_seq, prompt_records=prompt_records)
    for c, r in zip(completions, rewards):
        group.samples.add(tokens=c.tokens, logprobs=c.logprobs, routing=c.routing.reshape(-1).tolist(), reward=r,
                          finish_reason=c.finish_reason, text=c.text)
    return group


# KEYS: the stream, the publish's token key; ARGV: the group's bytes, its version, how long the token is kept (ms)
_PUBLISH_ONCE = """
local id = redis.call('GET', KEYS[2])
if id then return id end
id = redis.call('XADD', KEYS[1], '*', 'group', ARGV[1], 'version', ARGV[2])
redis.call('SET', KEYS[2], id, 'PX', ARGV[3])
return id
"""
TOKEN_TTL_MS = 600_000  # far longer than a command's retries (~27 s)


class TrajectoryStream:
    """Writer side of the stream (binary values: a client without response decoding)."""

    def __init__(self, url: str, run: str):
        self.client = connect(url, decode_responses=False)
        self.key = stream_key(run)
        self._publish_once = self.client.register_script(_PUBLISH_ONCE)

    def publish(self, group: pb.TrajectoryGroup, token: str | None = None) -> bytes:
        """The group's entry id. `token` names this publish (default: a new one); a second publish under the same
        token returns the first's id and adds nothing."""
        token_key = f"{self.key}:published:{token or uuid.uuid4().hex}"
        return self._publish_once(keys=[self.key, token_key],
                                  args=[group.SerializeToString(), group.policy_version, TOKEN_TTL_MS])

    def waiting(self, fresh: int, max_staleness: int) -> tuple[list[int], int | None]:
        """The versions of the groups not consumed yet, in stream order, up to the `fresh`-th one the dataloader's next
        step could use, and that step (`rollout_stream.unread_versions`)."""
        return rollout_stream.unread_versions(self.client, self.key, fresh, max_staleness)

    def close(self) -> None:
        self.client.close()
