"""The registry's lookup against a real Redis: a service's live records in key order, others' left out, in a few round
trips whatever the number of records (the rollout workers poll it several times a second: one SCAN of up to
`SCAN_COUNT` keys a trip and one MGET, not a trip per ten keys and a GET per record); and a claim that a Redis restart
left unanswered."""

from __future__ import annotations

import json
import os
import uuid

from services.common.registry import SCAN_COUNT, Registry

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def test_lookup_reads_every_live_record_of_the_service_in_a_few_round_trips():
    registry = Registry(REDIS_URL, f"lookup-{uuid.uuid4().hex[:8]}")
    client = registry.client
    keys = [registry._key("svc", "rollout", f"w{i:03d}") for i in range(60)]
    others = [registry._key("svc", "trainer", "rank0"), registry._key("svc", "rollouts", "x")]
    try:
        for i, key in enumerate(keys):
            client.set(key, json.dumps({"worker": f"w{i:03d}"}), px=60_000)
        for key in others:
            client.set(key, json.dumps({"worker": "other"}), px=60_000)
        trips = []
        plain = client.execute_command
        client.execute_command = lambda *args, **kw: trips.append(args[0]) or plain(*args, **kw)
        try:
            records = registry.lookup("rollout")
        finally:
            del client.execute_command
        assert [r["worker"] for r in records] == [f"w{i:03d}" for i in range(60)]
        assert trips.count("MGET") == 1 and "GET" not in trips
        assert trips.count("SCAN") <= client.dbsize() // SCAN_COUNT + 1, trips
        assert len(registry.services()) == 62
        client.delete(keys[7])  # expired or stopped: gone from the next lookup
        assert "w007" not in [r["worker"] for r in registry.lookup("rollout")]
    finally:
        client.delete(*keys, *others)


def test_lookup_of_a_service_without_records_is_empty():
    registry = Registry(REDIS_URL, f"lookup-{uuid.uuid4().hex[:8]}")
    assert registry.lookup("rollout") == [] and registry.services() == []


def test_a_claim_whose_set_was_applied_but_unanswered_keeps_its_slot():
    """A Redis that dies between applying a claim's SET NX and replying: the client retries it on the restarted server,
    which has the record (append-only file) and refuses the second SET; the claim is still ours, not the next slot."""
    registry = Registry(REDIS_URL, f"claim-{uuid.uuid4().hex[:8]}")
    real_set = registry.client.set

    def applied_then_refused(*args, **kwargs):
        real_set(*args, **kwargs)
        return None  # what the retried SET NX answers

    registry.client.set = applied_then_refused
    slot, heartbeat = registry.claim("rollout", 2, {"worker": "w"})
    try:
        assert slot == 0
        assert [r["instance"] for r in registry.lookup("rollout")] == ["replica0"]
    finally:
        heartbeat.stop()
