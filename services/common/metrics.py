"""Prometheus metrics for every service: the HTTP exporter they share, and the families of the trainer, the checkpointer
and the rollout workers (the dataloader's collector reads its engine at scrape time: services/dataloader/metrics.py).

Each exporter owns a `CollectorRegistry` (several may share a process in tests) served on a free port of `run.bind_host`
(127.0.0.1 unless configured; not authenticated, see services/common/net.py); the service puts `endpoint` into its
registry record under the key `metrics`, which is where `foldmoe status` and a Prometheus scrape config built from the
registry find it. Updating a metric is a dict update under a lock: the hot loops pay nothing measurable for it.

    trainer        foldmoe_trainer_{step, loss, grad_norm, lr, tokens_per_second, mfu, step_seconds,
                   step_data_wait_seconds, step_checkpoint_stall_seconds, max_expert_load_ratio}
                                                                                        gauges (latest step)
                   foldmoe_trainer_expert_load{expert}                                  gauge (tokens routed, latest step)
                   foldmoe_trainer_{tokens, data_wait_seconds, checkpoint_stall_seconds}_total   counters
    checkpointer   foldmoe_checkpointer_{saves_committed, saves_failed, bytes_written}_total      counters
                   foldmoe_checkpointer_save_seconds                                    histogram (first part to commit)
                   foldmoe_checkpointer_last_committed_step                             gauge
    rollout        foldmoe_rollout_{tokens, groups, samples}_total                      counters
                   foldmoe_rollout_{tokens_per_second, mean_reward, weights_version, staleness_versions}   gauges
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from services.common import net


class MetricsServer:
    """Serves one `CollectorRegistry` at `endpoint` (`GET /metrics`, text exposition format) from a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, advertise: str = ""):
        """Listens on `host`; `endpoint` names `advertise` (see net.advertised)."""
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._httpd.server_port
        self.endpoint = f"http://{net.advertised(host, advertise)}:{self.port}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class Exporter:
    """A service's metrics: its own registry, optionally served over HTTP (`serve`), closed with `close`."""

    prefix = "foldmoe_"

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.server: MetricsServer | None = None

    @property
    def endpoint(self) -> str:
        return self.server.endpoint if self.server is not None else ""

    def serve(self, host: str = "127.0.0.1", port: int = 0, advertise: str = ""):
        self.server = MetricsServer(self.registry, host, port, advertise)
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(self.prefix + name, doc, labels, registry=self.registry)

    def _counter(self, name: str, doc: str) -> Counter:
        # prometheus_client appends `_total` to a counter's exposed sample name.
        return Counter(self.prefix + name, doc, registry=self.registry)


def _number(value: Any) -> float | None:
    """A record's number, or None when it has none (mfu is None without a known peak). NaN stays NaN: a diverged
    loss must show up in the scrape as what it is."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class TrainerMetrics(Exporter):
    """Fed by the trainer's per-step record (the dict it writes to `run.metrics_file`): `observe(record)`."""

    prefix = "foldmoe_trainer_"
    # record key -> (metric name, help)
    GAUGES = {
        "step": ("step", "Optimizer steps completed."),
        "loss": ("loss", "Training loss of the latest step (mean per loss token)."),
        "grad_norm": ("grad_norm", "Global gradient norm of the latest step, before clipping."),
        "lr": ("lr", "Learning rate of the latest step."),
        "tokens_per_s": ("tokens_per_second", "Tokens per second over the latest step, all ranks."),
        "mfu": ("mfu", "Model FLOPs utilisation of the latest step against the datasheet peak."),
        "step_time_s": ("step_seconds", "Wall time of the latest step."),
        "data_wait_s": ("step_data_wait_seconds", "Seconds the latest step waited for its micro-batches."),
        "ckpt_stall_s": ("step_checkpoint_stall_seconds", "Seconds the latest step was held by a checkpoint save."),
        "max_load_ratio": ("max_expert_load_ratio", "Largest expert load over the mean load, latest step."),
        "eval_loss": ("eval_loss", "Held-out loss of the latest evaluation (mean per loss token over the evaluation "
                                   "set; run.eval_interval)."),
        "mtp_loss": ("mtp_loss", "Multi-token prediction cross-entropy of the latest step (per target token over "
                                 "the whole step, averaged over the depths; with model.mtp_num_layers)."),
    }

    def __init__(self) -> None:
        super().__init__()
        self.gauges = {key: self._gauge(name, doc) for key, (name, doc) in self.GAUGES.items()}
        self.expert_load = self._gauge("expert_load", "Tokens routed to each expert in the latest step (mean over "
                                       "MoE layers).", ("expert",))
        self.tokens = self._counter("tokens", "Tokens trained on (all ranks).")
        self.data_wait = self._counter("data_wait_seconds", "Seconds spent waiting for micro-batches.")
        self.stall = self._counter("checkpoint_stall_seconds", "Seconds training was held by checkpoint saves.")

    def observe(self, record: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            value = _number(record.get(key))
            if value is not None:
                gauge.set(value)
        for expert, load in enumerate(record.get("expert_load") or []):
            self.expert_load.labels(expert=str(expert)).set(float(load))
        tps, dt = _number(record.get("tokens_per_s")), _number(record.get("step_time_s"))
        if tps is not None and dt is not None and math.isfinite(tps * dt):
            self.tokens.inc(tps * dt)
        for counter, key in ((self.data_wait, "data_wait_s"), (self.stall, "ckpt_stall_s")):
            seconds = _number(record.get(key))
            if seconds is not None and math.isfinite(seconds) and seconds > 0:
                counter.inc(seconds)


class CheckpointerMetrics(Exporter):
    """The writer calls `committed(step, nbytes, seconds)` or `failed()` once per save it finishes."""

    prefix = "foldmoe_checkpointer_"

    def __init__(self) -> None:
        super().__init__()
        self.saves_committed = self._counter("saves_committed", "Saves committed.")
        self.saves_failed = self._counter("saves_failed", "Saves that failed (the previous checkpoint stays valid).")
        self.bytes_written = self._counter("bytes_written", "Bytes of committed checkpoint files.")
        self.save_seconds = Histogram(self.prefix + "save_seconds", "Seconds from a save's first part to its commit.",
                                      registry=self.registry,
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, math.inf))
        self.last_step = self._gauge("last_committed_step", "Step of the newest committed checkpoint.")

    def committed(self, step: int, nbytes: int, seconds: float) -> None:
        self.saves_committed.inc()
        self.bytes_written.inc(nbytes)
        self.save_seconds.observe(seconds)
        self.last_step.set(step)

    def failed(self) -> None:
        self.saves_failed.inc()


class RolloutMetrics(Exporter):
    """A rollout worker calls `batch(...)` after each generated batch."""

    prefix = "foldmoe_rollout_"

    def __init__(self) -> None:
        super().__init__()
        self.tokens = self._counter("tokens", "Completion tokens generated.")
        self.groups = self._counter("groups", "Trajectory groups published.")
        self.samples = self._counter("samples", "Completions scored.")
        self.tokens_per_second = self._gauge("tokens_per_second", "Completion tokens per second, latest batch.")
        self.mean_reward = self._gauge("mean_reward", "Mean reward of the latest batch.")
        self.version = self._gauge("weights_version", "Policy weights version the latest batch was generated with.")
        self.staleness = self._gauge("staleness_versions", "Versions the worker's weights are behind the newest seen.")
        self.prompt_prefilled = self._counter("prompt_tokens_prefilled", "Prompt tokens run through prefill.")
        self.prompt_shared = self._counter("prompt_tokens_shared", "Prompt tokens copied from another slot's KV cache "
                                           "(a group's shared prompt, a shared prefix) instead of prefilled.")

    def batch(self, tokens: int, seconds: float, rewards: list[float], groups: int, version: int,
              behind: int, prompt_prefilled: int = 0, prompt_shared: int = 0) -> None:
        self.tokens.inc(tokens)
        self.prompt_prefilled.inc(prompt_prefilled)
        self.prompt_shared.inc(prompt_shared)
        self.groups.inc(groups)
        self.samples.inc(len(rewards))
        if seconds > 0:
            self.tokens_per_second.set(tokens / seconds)
        if rewards:
            self.mean_reward.set(sum(rewards) / len(rewards))
        self.version.set(version)
        self.staleness.set(behind)
