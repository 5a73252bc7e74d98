"""The registry's heartbeat: a record's last write is always its newest content (an update is never overwritten by a
beat of the record before it: the rollout workers' reservations ride on updates), and a stopped heartbeat's record
stays gone (no beat in flight brings it back for a TTL)."""

from __future__ import annotations

import json
import threading
import time

from services.common.registry import Heartbeat


class SlowRedis:
    """SET and DELETE of one key; the heartbeat thread's writes take 2 ms to land, as over a network."""

    def __init__(self):
        self.value, self.lock = None, threading.Lock()

    def set(self, key, value, px=None):
        if threading.current_thread().name.startswith("heartbeat"):
            time.sleep(0.002)
        with self.lock:
            self.value = value

    def delete(self, key):
        with self.lock:
            self.value = None


def test_the_last_write_is_the_newest_record_and_a_stopped_record_stays_gone():
    client = SlowRedis()
    beat = Heartbeat(client, "k", {"n": 0}, ttl=0.006)  # a beat every 2 ms
    try:
        for n in range(1, 150):
            beat.update(n=n)
            time.sleep(0.001)
            assert json.loads(client.value)["n"] == n, f"update {n} overwritten by a beat of an older record"
    finally:
        beat.stop()
    time.sleep(0.02)
    assert client.value is None
