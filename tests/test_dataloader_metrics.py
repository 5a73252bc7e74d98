"""Prometheus metrics of the dataloader service.

Specification: the service registers a `metrics` HTTP endpoint next to its ZMQ and gRPC ones; scraping it yields queue
depth, packing efficiency, throughput and served steps that agree with what the clients received and with Status.
"""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from services.dataloader.server import DataLoaderServer
from tests.test_dataloader_service import clients, make_cfg, registry, steps  # noqa: F401


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def test_metrics_endpoint_is_registered_and_reports_what_was_served(tmp_path, registry):
    cfg = make_cfg(tmp_path)
    server = DataLoaderServer(cfg, registry).start()
    try:
        (record,) = registry.lookup("dataloader")
        assert record["metrics"] == server.metrics_endpoint and record["metrics"].startswith("http://127.0.0.1:")
        before = scrape(record["metrics"])
        assert before["foldmoe_dataloader_micro_batches_sent_total"] == 0
        assert before["foldmoe_dataloader_steps_served_total"] == 0

        cls = clients(registry, cfg, dp_size=2, tp=1)
        got = steps(cls, 6)
        received = sum(len(rank) for step in got for rank in step)
        real_tokens = sum(int((mb["labels"] != -100).sum()) for step in got for rank in step for mb in rank)
        time.sleep(0.3)  # the service spends the clients' last credits, then nothing changes until they take more
        m = scrape(record["metrics"])
        status = server.engine.status()
        sent = m["foldmoe_dataloader_micro_batches_sent_total"]
        # prefetch: the service may be a few credits ahead of what the clients took off their sockets
        assert received <= sent <= received + 2 * cfg.data.prefetch
        assert m["foldmoe_dataloader_tokens_sent_total"] >= real_tokens > 0
        assert m["foldmoe_dataloader_steps_served_total"] >= 5  # every rank received steps 0..4 in full
        assert m["foldmoe_dataloader_steps_produced_total"] >= 6
        assert m["foldmoe_dataloader_queue_depth_steps"] == status.buffered_steps <= server.engine.max_buffered
        assert m["foldmoe_dataloader_packing_efficiency"] == status.efficiency > 0.9
        assert m["foldmoe_dataloader_tokens_per_second"] > 0 and m["foldmoe_dataloader_micro_batches_per_second"] > 0
        assert m["foldmoe_dataloader_clients{kind=joined}"] == m["foldmoe_dataloader_clients{kind=expected}"] == 2
        assert m["foldmoe_dataloader_next_step"] == status.next_step >= 6
        for c in cls:
            c.close()
    finally:
        server.stop()


def test_two_services_in_one_process_export_their_own_numbers(tmp_path):
    a = DataLoaderServer(make_cfg(tmp_path)).start()
    b = DataLoaderServer(make_cfg(tmp_path)).start()
    try:
        assert a.metrics_endpoint != b.metrics_endpoint
        a.engine.sent = 7
        assert scrape(a.metrics_endpoint)["foldmoe_dataloader_micro_batches_sent_total"] == 7
        assert scrape(b.metrics_endpoint)["foldmoe_dataloader_micro_batches_sent_total"] == 0
    finally:
        a.stop()
        b.stop()
