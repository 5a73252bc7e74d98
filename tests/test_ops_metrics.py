"""The Prometheus exporters of the trainer, checkpointer and rollout workers (services/common/metrics.py): what a
scrape of their endpoint returns after the service reported its work, on a loopback port of its own."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import CheckpointerMetrics, RolloutMetrics, TrainerMetrics


def scrape(endpoint: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(endpoint, timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


RECORD = {"step": 7, "loss": 2.5, "grad_norm": 0.75, "lr": 1e-3, "tokens_per_s": 1000.0, "step_time_s": 0.5,
          "data_wait_s": 0.01, "ckpt_stall_s": 0.2, "mfu": None, "expert_load": [10.0, 30.0], "max_load_ratio": 1.5}


@pytest.fixture
def trainer():
    exporter = TrainerMetrics().serve()
    yield exporter
    exporter.close()


def test_trainer_exporter_serves_the_latest_step_and_running_totals(trainer):
    assert trainer.endpoint.startswith("http://127.0.0.1:")
    trainer.observe({**RECORD, "step": 6, "loss": 3.0})
    trainer.observe(RECORD)
    got = scrape(trainer.endpoint)
    assert got[("foldmoe_trainer_step", ())] == 7
    assert got[("foldmoe_trainer_loss", ())] == 2.5  # the latest step, not the first
    assert got[("foldmoe_trainer_grad_norm", ())] == 0.75
    assert got[("foldmoe_trainer_tokens_per_second", ())] == 1000.0
    assert got[("foldmoe_trainer_max_expert_load_ratio", ())] == 1.5
    assert got[("foldmoe_trainer_expert_load", (("expert", "0"),))] == 10.0
    assert got[("foldmoe_trainer_expert_load", (("expert", "1"),))] == 30.0
    assert got[("foldmoe_trainer_tokens_total", ())] == 1000.0  # 2 steps x 1000 tok/s x 0.5 s
    assert got[("foldmoe_trainer_checkpoint_stall_seconds_total", ())] == pytest.approx(0.4)
    assert got[("foldmoe_trainer_data_wait_seconds_total", ())] == pytest.approx(0.02)


def test_trainer_exporter_skips_missing_values_and_shows_a_diverged_loss_as_nan(trainer):
    trainer.observe({**RECORD, "mfu": 0.4})
    trainer.observe({"step": 8, "loss": float("nan"), "mfu": None})
    got = scrape(trainer.endpoint)
    assert got[("foldmoe_trainer_step", ())] == 8
    assert math.isnan(got[("foldmoe_trainer_loss", ())])
    assert got[("foldmoe_trainer_mfu", ())] == 0.4  # a record without a value leaves the last one
    assert got[("foldmoe_trainer_tokens_total", ())] == 500.0  # the second record has no throughput


def test_checkpointer_exporter_counts_saves_bytes_and_durations():
    exporter = CheckpointerMetrics().serve()
    try:
        exporter.committed(step=10, nbytes=1000, seconds=0.3)
        exporter.committed(step=20, nbytes=500, seconds=3.0)
        exporter.failed()
        got = scrape(exporter.endpoint)
    finally:
        exporter.close()
    assert got[("foldmoe_checkpointer_saves_committed_total", ())] == 2
    assert got[("foldmoe_checkpointer_saves_failed_total", ())] == 1
    assert got[("foldmoe_checkpointer_bytes_written_total", ())] == 1500
    assert got[("foldmoe_checkpointer_last_committed_step", ())] == 20
    assert got[("foldmoe_checkpointer_save_seconds_count", ())] == 2
    assert got[("foldmoe_checkpointer_save_seconds_bucket", (("le", "0.5"),))] == 1
    assert got[("foldmoe_checkpointer_save_seconds_sum", ())] == pytest.approx(3.3)


def test_rollout_exporter_reports_throughput_reward_and_staleness():
    exporter = RolloutMetrics().serve()
    try:
        exporter.batch(tokens=200, seconds=2.0, rewards=[1.0, 0.0, 0.5, 0.5], groups=1, version=4, behind=1)
        got = scrape(exporter.endpoint)
    finally:
        exporter.close()
    assert got[("foldmoe_rollout_tokens_total", ())] == 200
    assert got[("foldmoe_rollout_tokens_per_second", ())] == 100
    assert got[("foldmoe_rollout_mean_reward", ())] == 0.5
    assert got[("foldmoe_rollout_samples_total", ())] == 4
    assert got[("foldmoe_rollout_weights_version", ())] == 4
    assert got[("foldmoe_rollout_staleness_versions", ())] == 1


def test_two_exporters_in_one_process_do_not_share_metrics():
    a, b = TrainerMetrics().serve(), TrainerMetrics().serve()
    try:
        a.observe({"step": 3})
        assert a.endpoint != b.endpoint
        assert scrape(b.endpoint)[("foldmoe_trainer_step", ())] == 0
    finally:
        a.close()
        b.close()
