"""Trajectory groups onto the run's Redis stream: one XADD per complete group, so a reader never sees half a group and
a worker that dies loses only the groups it had not finished."""

from __future__ import annotations

import json
import time
from typing import Any

from proto import rollout_pb2 as pb
from services.common import rollout_stream
from services.common.registry import connect
from services.rl_rollout.engine import Completion


def stream_key(run: str) -> str:
    return f"foldmoe:{run}:rl:trajectories"


def encode_group(group_id: str, worker: str, version: int, task: str, prompt: str, meta: dict[str, Any],
                 temperature: float, completions: list[Completion], rewards: list[float]) -> pb.TrajectoryGroup:
    first = completions[0]
    group = pb.TrajectoryGroup(
        group_id=group_id, worker=worker, policy_version=version, task=task, prompt=prompt,
        prompt_tokens=first.prompt_tokens, meta_json=json.dumps(meta), temperature=temperature,
        moe_layers=first.routing.shape[0], top_k=first.routing.shape[2] if first.routing.ndim == 3 else 0,
        created_unix=time.time())
    for c, r in zip(completions, rewards):
        group.samples.add(tokens=c.tokens, logprobs=c.logprobs, routing=c.routing.reshape(-1).tolist(), reward=r,
                          finish_reason=c.finish_reason, text=c.text)
    return group


class TrajectoryStream:
    """Writer side of the stream (binary values: a client without response decoding)."""

    def __init__(self, url: str, run: str):
        self.client = connect(url, decode_responses=False)
        self.key = stream_key(run)

    def publish(self, group: pb.TrajectoryGroup) -> bytes:
        return self.client.xadd(self.key, {"group": group.SerializeToString(), "version": group.policy_version})

    def waiting(self, fresh: int, max_staleness: int) -> tuple[list[int], int | None]:
        """The versions of the groups not consumed yet, in stream order, up to the `fresh`-th one the dataloader's next
        step could use, and that step (`rollout_stream.unread_versions`)."""
        return rollout_stream.unread_versions(self.client, self.key, fresh, max_staleness)

    def close(self) -> None:
        self.client.close()
