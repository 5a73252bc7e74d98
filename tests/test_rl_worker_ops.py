"""The rollout worker's operational contract: reproducible prompts, Prometheus metrics, gRPC health and status.

- The prompts a worker asks are a function of `run.seed` and its worker id only (`--worker-id`).
- The worker serves `foldmoe_rollout_*` metrics (services/common/metrics.py) and names the endpoint in its registry
  record, as the trainer and the checkpointer do; after a batch they hold its tokens, samples, reward and weights version.
- The worker serves the standard gRPC health service and RolloutControl.Status at its record's "grpc" address (what the
  launcher, compose and `foldmoe status` probe): SERVING from registration, its weights version and output after a
  batch, which `foldmoe status` shows; a worker that fails to start leaves no registration behind.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import redis

from proto import rollout_pb2, rollout_pb2_grpc
from services import cli
from services.common import grpc_server
from services.common import rollout_stream
from services.common.config import load_config
from services.common.registry import Registry
from services.rl_rollout.publish import stream_key
from services.rl_rollout.worker import RolloutWorker
from services.trainer.model.transformer import MoETransformer
from services.trainer.rl.weight_publisher import WeightPublisher

sys.path.insert(0, str(Path(__file__).parent))
from test_ops_metrics import scrape  # noqa: E402

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_experts=4", "model.moe_ffn_hidden_size=32",
        "model.ffn_hidden_size=64", "rl.group_size=4", "rl.prompts_per_batch=3", "rl.max_new_tokens=4",
        "rl.max_batch=16", "rl.max_seq_len=32", "rl.weight_dtype=fp32", "rl.difficulty=2"]


@pytest.fixture
def run():
    name = f"rl-worker-ops-{uuid.uuid4().hex[:8]}"
    yield name
    redis.Redis.from_url(REDIS_URL).delete(stream_key(name))


def prompts(run: str, worker_id: str, seed: int, batches: int = 2) -> list[str]:
    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", f"run.seed={seed}", *TINY])
    worker = RolloutWorker(cfg, Registry(REDIS_URL, run), worker_id=worker_id)
    try:
        return [p.prompt for _ in range(batches) for p in worker.next_prompts()]
    finally:
        worker.close()


def test_prompts_are_reproducible_from_the_seed_and_the_worker_id(run):
    first = prompts(run, "rollout0", seed=3)
    assert len(first) == 6 and len(set(first)) > 1
    assert prompts(run, "rollout0", seed=3) == first  # a restarted worker asks the same questions, in order
    assert prompts(run, "rollout1", seed=3) != first  # another worker asks others
    assert prompts(run, "rollout0", seed=4) != first  # and so does another run seed


@contextmanager
def worker_with_a_publisher(cfg, registry: Registry, versions: tuple[int, ...]):
    """A worker "rollout0" beside a trainer's weight publisher that has published `versions`; all closed after."""
    model = MoETransformer(cfg.model)
    model.init_weights(0)
    publisher = WeightPublisher.from_config(cfg.rl).start()
    for version in versions:
        publisher.publish(version, model.state_dict())
    beat = registry.register("rl_weights", {"zmq": publisher.endpoint})
    worker = RolloutWorker(cfg, registry, worker_id="rollout0")
    try:
        yield worker
    finally:
        worker.stream.client.delete(rollout_stream.read_position_key(worker.stream.key))
        worker.close()
        beat.stop()
        publisher.stop()


def test_worker_exports_throughput_reward_and_staleness_metrics(run):
    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", *TINY])
    registry = Registry(REDIS_URL, run)
    with worker_with_a_publisher(cfg, registry, (0, 1)) as worker:
        (record,) = registry.lookup("rollout")
        assert record["metrics"] == worker.metrics.endpoint and record["metrics"].startswith("http://")
        before = scrape(record["metrics"])
        assert before[("foldmoe_rollout_samples_total", ())] == 0
        assert worker.policy.refresh(timeout_s=10)
        worker.run_batch()
        got = scrape(record["metrics"])
        entries = worker.stream.client.xrange(worker.stream.key)
        groups = [rollout_pb2.TrajectoryGroup.FromString(fields[b"group"]) for _, fields in entries]
        # the backlog the worker throttles on: the versions of what the dataloader has not consumed yet
        assert worker.stream.waiting(100, 1) == ([1] * len(entries), None) and len(entries) == cfg.rl.prompts_per_batch
        rollout_stream.mark_read(worker.stream.client, worker.stream.key, entries[1][0].decode(), next_step=2)
        assert worker.stream.waiting(100, 1) == ([1] * (len(entries) - 2), 2)
        assert worker.stream.waiting(1, 1) == ([1], 2)  # up to the first fresh one
        assert worker.stream.waiting(1, 0) == ([1], 2)  # a stale one comes along, and there is no fresh one after it
    samples = [s for g in groups for s in g.samples]
    assert got[("foldmoe_rollout_samples_total", ())] == len(samples) == 12
    assert got[("foldmoe_rollout_groups_total", ())] == 3
    assert got[("foldmoe_rollout_tokens_total", ())] == sum(len(s.tokens) for s in samples)
    assert got[("foldmoe_rollout_tokens_per_second", ())] > 0
    assert got[("foldmoe_rollout_mean_reward", ())] == pytest.approx(sum(s.reward for s in samples) / len(samples))
    assert got[("foldmoe_rollout_weights_version", ())] == 1  # the newest published
    assert got[("foldmoe_rollout_staleness_versions", ())] == 0
    # each group's 4 samples join together: its prompt prefilled once and copied, but for its last token, into 3 slots
    prompts = [len(g.prompt_tokens) for g in groups]
    assert got[("foldmoe_rollout_prompt_tokens_prefilled_total", ())] == sum(prompts)
    assert got[("foldmoe_rollout_prompt_tokens_shared_total", ())] == sum(3 * (n - 1) for n in prompts)
    assert all(len(s.logprobs) == len(s.tokens) for s in samples)


def test_workers_without_an_id_claim_stable_slots_and_a_restart_takes_the_freed_one(run):
    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", "rl.workers=2", *TINY])
    registry = Registry(REDIS_URL, run)
    first, second = RolloutWorker(cfg, registry), RolloutWorker(cfg, registry)
    try:
        assert (first.worker_id, second.worker_id) == ("worker0", "worker1")
        records = {r["instance"]: r for r in registry.lookup("rollout")}
        assert records["replica0"]["worker"] == "worker0" and records["replica1"]["worker"] == "worker1"
        asked = [p.prompt for p in first.next_prompts()]
        assert asked != [p.prompt for p in second.next_prompts()]
        first.close()  # stops its heartbeat: the slot is free again
        again = RolloutWorker(cfg, registry)
        try:
            assert again.worker_id == "worker0"
            assert [p.prompt for p in again.next_prompts()] == asked  # the same questions as the worker it replaces
        finally:
            again.close()
    finally:
        second.close()


def test_worker_serves_grpc_health_and_its_status(run, tmp_path, capsys):
    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", *TINY])
    registry = Registry(REDIS_URL, run)
    with worker_with_a_publisher(cfg, registry, (3,)) as worker:
        (record,) = registry.lookup("rollout")
        assert grpc_server.check(record["grpc"]) and grpc_server.check(record["grpc"], "foldmoe.v1.RolloutControl")
        assert grpc_server.probe_registered(REDIS_URL, run, "rollout") == ""
        with grpc.insecure_channel(record["grpc"]) as channel:
            status = rollout_pb2_grpc.RolloutControlStub(channel)
            before = status.Status(rollout_pb2.RolloutStatusRequest(), timeout=5)
            assert (before.worker, before.weights_version, before.groups_published) == ("rollout0", -1, 0)
            assert worker.policy.refresh(timeout_s=10)
            worker.run_batch()
            after = status.Status(rollout_pb2.RolloutStatusRequest(), timeout=5)
        assert (after.weights_version, after.newest_version_seen) == (3, 3)
        assert after.groups_published == cfg.rl.prompts_per_batch
        assert after.tokens_generated == worker.tokens_generated > 0
        shown = load_config("configs/rl_tiny.yaml", [f"run.name={run}", f"run.redis_url={REDIS_URL}",
                                                    f"run.metrics_file={tmp_path / 'none.jsonl'}"])
        capsys.readouterr()
        assert cli.status(shown) == 0  # `foldmoe status` shows it under the worker's line
        out = capsys.readouterr().out
        assert "SERVING" in out and f"weights v3 (newest seen v3), {cfg.rl.prompts_per_batch} groups, " \
            f"{worker.tokens_generated} tokens" in out
    assert not grpc_server.check(record["grpc"], timeout=0.5)  # closed with the worker


def test_a_worker_that_fails_to_start_leaves_no_registration(run, monkeypatch):
    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", *TINY])
    registry = Registry(REDIS_URL, run)

    def broken(*args, **kwargs):
        raise RuntimeError("engine could not start")

    monkeypatch.setattr("services.rl_rollout.worker.Engine", broken)
    with pytest.raises(RuntimeError, match="engine could not start"):
        RolloutWorker(cfg, registry, worker_id="rollout0")
    assert registry.lookup("rollout") == []


def test_a_worker_generates_only_what_the_steps_that_can_train_on_it_will_read(run, monkeypatch):
    """Step s trains on groups of versions s - max_staleness .. s, reading them in stream order: a worker with weights
    of version v stops once the groups waiting fill the steps up to v + max_staleness (a longer backlog only goes
    stale), generates while they leave room, counts none of the waiting groups those steps will drop as stale, and
    stops at `max_queued_groups` whatever the room."""
    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", *TINY, "rl.groups_per_step=3", "rl.max_staleness=1",
                                               "rl.max_queued_groups=8"])
    worker = RolloutWorker(cfg, Registry(REDIS_URL, run), worker_id="rollout0")
    try:
        worker.policy.version = 5
        # (waiting versions, next step) -> generates: steps 5 and 6 read at most 6 groups of version 5 (5 waiting: room,
        # 6: none); step 6 alone 3 (it drops the 4s: room after two 5s, none after three); step 7 none; step 5 reads
        # three 4s and step 6 drops the fourth (room after two 5s); 8 waiting is max_queued_groups; before the
        # dataloader's first step, from our version's step on; 8 stale groups (too old for step 5) hold no worker back
        for waiting, next_step, generates in (([5] * 5, 5, True), ([5] * 6, 5, False), ([4] * 2 + [5] * 2, 6, True),
                                              ([4] * 2 + [5] * 3, 6, False), ([4] * 6, 6, True), ([], 7, False),
                                              ([4] * 4 + [5] * 2, 5, True), ([5] * 8, None, False),
                                              ([5] * 5, None, True), ([3] * 8 + [5] * 5, 5, True)):
            asked, generated = [], []
            monkeypatch.setattr(worker.stream, "waiting", lambda limit, staleness, w=waiting, n=next_step:
                                asked.append(limit) or (w, n))
            monkeypatch.setattr(worker, "run_batch", lambda n: generated.append(n) or worker.stop.set())
            monkeypatch.setattr(worker.policy, "refresh", lambda: True)
            timer = threading.Timer(0.3, worker.stop.set)
            timer.start()
            worker.run()
            timer.cancel()
            worker.stop.clear()
            assert set(asked) == {8} and bool(generated) == generates, f"waiting {waiting}, next step {next_step}"
    finally:
        worker.close()


def test_workers_deciding_at_once_share_the_room_and_take_no_more_than_it(run, monkeypatch):
    """A worker takes min(room, `rl.prompts_per_batch`) prompts and reserves them in its registry record until it
    has published their groups; the others count the reservation as waiting groups, and decide one at a time
    (`rollout_stream.deciding`). Room 3 (steps 5 and 6 read 6 groups of version 5, 3 wait), two workers of 3 prompts
    a batch starting together: one takes the 3, the other none (without the reservation both took 3: 3 go stale)."""
    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", *TINY, "rl.groups_per_step=3", "rl.max_staleness=1",
                                               "rl.max_queued_groups=8"])
    workers = [RolloutWorker(cfg, Registry(REDIS_URL, run), worker_id=f"rollout{i}") for i in range(2)]
    taken, during, published = {}, {}, []
    try:
        start = threading.Barrier(2)
        for w in workers:
            w.policy.version = 5
            monkeypatch.setattr(w.stream, "waiting", lambda limit, staleness: ([5] * 3 + published, 5))
            monkeypatch.setattr(w.policy, "refresh", lambda b=start: b.n_waiting >= 0)

            def batch(n, w=w):
                taken[w.worker_id] = n
                during[w.worker_id] = {r["worker"]: r.get("reserved") for r in w.registry.lookup("rollout")}
                time.sleep(0.3)  # generating: the other worker decides meanwhile
                published.extend([5] * n)  # its groups, in the stream once generated
                w.stop.set()
            monkeypatch.setattr(w, "run_batch", batch)
        threads = [threading.Thread(target=lambda w=w: (start.wait(), w.run())) for w in workers]
        for t in threads:
            t.start()
        time.sleep(1.0)
        for w in workers:
            w.stop.set()
        for t in threads:
            t.join(5)
        assert sorted(taken.values()) == [3], taken  # one batch of 3 prompts, none for the other worker
        (first, seen), = during.items()
        assert seen[first] == [5, 3] and not seen[next(w.worker_id for w in workers if w.worker_id != first)]
        records = {r["worker"]: r.get("reserved") for r in workers[0].registry.lookup("rollout")}
        assert not any(records.values()), records  # released after the batch
    finally:
        for w in workers:
            w.close()


def test_the_decision_lock_is_held_by_one_worker_at_a_time_and_freed_when_its_holder_dies(run):
    """`rollout_stream.deciding`: a second holder waits for the first; a holder that died (its key left behind) frees
    it once its hold expires; a holder leaving does not release a lock another took after its own expired."""
    client = redis.Redis.from_url(REDIS_URL)
    stream = stream_key(run)
    try:
        order = []

        def hold(name, seconds):
            with rollout_stream.deciding(client, stream):
                order.append(f"{name} in")
                time.sleep(seconds)
                order.append(f"{name} out")
        first = threading.Thread(target=hold, args=("a", 0.2))
        first.start()
        time.sleep(0.05)
        hold("b", 0)
        first.join()
        assert order == ["a in", "a out", "b in", "b out"]
        client.set(f"{stream}:deciding", "dead", px=300)  # a holder killed inside
        t0 = time.monotonic()
        with rollout_stream.deciding(client, stream, hold_ms=100):
            assert time.monotonic() - t0 >= 0.25
            time.sleep(0.15)  # ours expires; another takes the lock
            assert client.set(f"{stream}:deciding", "other", nx=True, px=1000)
        assert client.get(f"{stream}:deciding") == b"other"
    finally:
        client.delete(f"{stream}:deciding")
        client.close()


def test_one_worker_evaluates_each_multiple_of_the_interval_greedily_on_a_fixed_prompt_set(run):
    """`rl.eval_interval`: the first worker holding weights at or past a multiple evaluates them, once per multiple
    across the run's workers; the prompts are fixed (the same for every worker id, apart from the training ones); the
    reward is the mean over one greedy completion each, stored in the run state for the trainer."""
    from services.rl_rollout.engine import Request
    from services.rl_rollout.sampling import SamplingParams

    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", *TINY, "rl.eval_interval=2", "rl.eval_prompts=5"])
    registry = Registry(REDIS_URL, run)
    with worker_with_a_publisher(cfg, registry, (0, 1, 2, 3)) as worker:
        assert worker.evaluate_due() is None  # no weights yet
        assert worker.policy.refresh(timeout_s=10) and worker.policy.version == 3
        result = worker.evaluate_due()
        assert result["version"] == 3 and result["prompts"] == 5 and registry.get_state("rl_eval") == result
        greedy = SamplingParams(temperature=0.0, max_tokens=cfg.rl.max_new_tokens, stop=tuple(cfg.rl.stop))
        texts = [c.text for c in worker.engine.generate([Request(worker.tokenizer.encode(p.prompt), greedy, tag=i)
                                                         for i, p in enumerate(worker.eval_set)])]
        rewards = [worker.prompts.reward(p.prompt, t, p.meta) for p, t in zip(worker.eval_set, texts)]
        assert result["reward"] == pytest.approx(sum(rewards) / 5)
        assert worker.evaluate_due() is None  # the multiple 2 is done
        other = RolloutWorker(cfg, registry, worker_id="rollout1")
        try:
            assert other.policy.refresh(timeout_s=10)
            assert other.evaluate_due() is None  # the turn is taken
            assert [p.prompt for p in other.eval_set] == [p.prompt for p in worker.eval_set]
            training = {p.prompt for p in worker.next_prompts(20)} | {p.prompt for p in other.next_prompts(20)}
            assert len({p.prompt for p in worker.eval_set} - training) >= 4  # (drawn apart; a repeat is possible)
        finally:
            other.close()
