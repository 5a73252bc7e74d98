"""Prometheus metrics of one dataloader service, served over HTTP (`GET /metrics`, text exposition format).

Values are read from the engine at scrape time under its lock, so the serving loop pays nothing for them. Each service
instance has its own collector registry (several servers may share a process in tests). The server registers the
endpoint as `metrics` next to `zmq` and `grpc` in its Redis record.

    foldmoe_dataloader_queue_depth_steps             gauge    steps produced and still buffered
    foldmoe_dataloader_credits_outstanding           gauge    micro-batches the joined ranks may still be sent
    foldmoe_dataloader_clients                       gauge    ranks joined to the current stream (and expected)
    foldmoe_dataloader_packing_efficiency            gauge    non-padding fraction of the positions packed since start
    foldmoe_dataloader_tokens_per_second             gauge    non-padding tokens sent per second, last few seconds
    foldmoe_dataloader_micro_batches_per_second      gauge    micro-batches sent per second, last few seconds
    foldmoe_dataloader_micro_batches_sent_total      counter  micro-batches sent (a TP peer's copy counts)
    foldmoe_dataloader_tokens_sent_total             counter  non-padding tokens sent
    foldmoe_dataloader_steps_produced_total          counter  steps packed
    foldmoe_dataloader_steps_served_total            counter  steps every expected rank has received in full
    foldmoe_dataloader_next_step                     gauge    first step not yet produced
    foldmoe_dataloader_epoch                         gauge    epoch of the slowest blended dataset
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common import metrics
from services.dataloader.engine import Engine

PREFIX = "foldmoe_dataloader_"


class EngineCollector(Collector):
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        with engine.lock:
            status = engine.status()
            counters = {"micro_batches_sent": (engine.sent, "Micro-batches sent (a TP peer's copy counts)."),
                        "tokens_sent": (engine.tokens_sent, "Non-padding tokens sent."),
                        "steps_produced": (engine.steps_produced, "Steps packed."),
                        "steps_served": (engine.steps_served, "Steps every expected rank has received in full.")}
        gauges = {
            "queue_depth_steps": (status.buffered_steps, "Steps produced and still buffered."),
            "credits_outstanding": (status.credits_outstanding, "Micro-batches the joined ranks may still be sent."),
            "packing_efficiency": (status.efficiency, "Non-padding fraction of the positions packed since start."),
            "tokens_per_second": (status.tokens_per_s, "Non-padding tokens sent per second, last few seconds."),
            "micro_batches_per_second": (status.micro_batches_per_s, "Micro-batches sent per second, last few seconds."),
            "next_step": (status.next_step, "First step not yet produced."),
            "epoch": (status.epoch, "Epoch of the slowest blended dataset."),
        }
        for name, (value, doc) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        clients = GaugeMetricFamily(PREFIX + "clients", "Ranks joined to the current stream, and expected.",
                                    labels=["kind"])
        clients.add_metric(["joined"], status.clients)
        clients.add_metric(["expected"], status.expected_clients)
        yield clients
        for name, (value, doc) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class MetricsServer(metrics.MetricsServer):
    """HTTP exporter of the engine's collector on a free port of `host`; `endpoint` is the URL to scrape."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", advertise: str = ""):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine))
        super().__init__(self.registry, host, advertise=advertise)
