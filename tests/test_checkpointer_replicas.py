"""Several writer replicas sharing one checkpoint directory, one per host.

Specification: each rank streams to the replica registered for its host; the replicas agree (through Redis) on
exactly one commit per save, every rank is told it is committed, and the checkpoint holds every rank's piece.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from services.checkpointer.load import find_latest_valid, load_checkpoint
from services.checkpointer.shard import Shard
from services.checkpointer.snapshot import Snapshotter, new_session
from services.common.registry import Registry

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379"


def test_ranks_on_two_hosts_use_their_own_replica_and_get_one_commit(tmp_path):
    run, ckpt = f"test-ckpt-{uuid.uuid4().hex[:8]}", tmp_path / "ckpt"
    hosts = ["host-a", "host-b"]
    writers = [subprocess.Popen([sys.executable, "-m", "services.checkpointer.writer", f"checkpoint.dir={ckpt}",
                                 f"run.name={run}"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "REDIS_URL": REDIS, "FOLDMOE_HOST": host}) for host in hosts]
    logs = []
    try:
        registry = Registry(REDIS, run)
        records = registry.wait_for("checkpointer", count=2, timeout=30)
        assert sorted(r["host"] for r in records) == hosts
        world, session = 4, new_session()
        # Ranks 0-1 on host-a, 2-3 on host-b; each rank holds a quarter of the rows.
        snaps = [Snapshotter(registry=registry, rank=r, world_size=world, host=hosts[r // 2], session=session)
                 for r in range(world)]
        full = {step: torch.randn(8, 3) for step in (1, 2)}
        for step, t in full.items():
            for r, snap in enumerate(snaps):
                snap.save(step, {"t": Shard(t[2 * r:2 * r + 2], (8, 3), (2 * r, 0))}, {"rank": r})
            paths = [snap.wait(30) for snap in snaps]
            assert paths == [str(ckpt / f"step_{step:08d}")] * world
        for snap in snaps:
            snap.close()
        latest = find_latest_valid(ckpt)
        with load_checkpoint(latest) as c:
            assert c.step == 2 and torch.equal(c.read("t"), full[2])
            assert [e["rank"] for e in c.extras] == list(range(world))
    finally:
        for w in writers:
            w.send_signal(signal.SIGTERM)
        for w in writers:
            logs.append(w.communicate(timeout=20)[1])
    for host, log in zip(hosts, logs):  # both replicas received parts of both saves
        assert "save of step 1 started" in log and "save of step 2 started" in log, (host, log)
    commits = sum(log.count("committed step 2") for log in logs)
    assert commits == 1, logs
