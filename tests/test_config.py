"""The config tree as a specification: YAML plus `section.key=value` overrides, and every mistake rejected at load
with a `ConfigError` that names the offending key."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import Config, ConfigError, load_config, validate

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_values_replace_defaults_and_the_rest_keep_theirs(tmp_path):
    cfg = load_config(write(tmp_path, "model:\n  hidden_size: 256\n  num_layers: 2\nrun:\n  steps: 7\n"))
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.run.steps) == (256, 2, 7)
    assert cfg.model.num_experts == Config().model.num_experts


def test_overrides_win_over_the_file_and_are_typed(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 2\n")
    cfg = load_config(path, ["model.num_layers=3", "optimizer.lr=5e-3", "checkpoint.resume=false",
                             "data.corpus=[/a, /b]", "run.name=x"])
    assert cfg.model.num_layers == 3
    assert cfg.optimizer.lr == pytest.approx(5e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.checkpoint.resume is False
    assert cfg.data.corpus == ["/a", "/b"]
    assert cfg.run.name == "x"


def test_later_override_wins():
    assert load_config(None, ["run.steps=5", "run.steps=9"]).run.steps == 9


@pytest.mark.parametrize("override, key", [
    ("model.hidden_sise=64", "model.hidden_sise"),
    ("modle.hidden_size=64", "modle"),
    ("run.stpes=3", "run.stpes"),
])
def test_unknown_key_error_names_the_key(override, key):
    with pytest.raises(ConfigError, match=f"unknown config key `{key}`"):
        load_config(None, [override])


def test_unknown_key_in_yaml_is_rejected_too(tmp_path):
    with pytest.raises(ConfigError, match="`optimizer.learning_rate`"):
        load_config(write(tmp_path, "optimizer:\n  learning_rate: 0.1\n"))


@pytest.mark.parametrize("overrides, key", [
    (["model.num_experts=4", "model.top_k=6"], "model.top_k"),
    (["model.hidden_size=130", "model.num_heads=4"], "model.hidden_size"),
    (["model.num_experts=8", "parallel.ep=3"], "parallel.ep"),
    (["model.num_heads=4", "model.num_kv_heads=3"], "model.num_heads"),
    (["model.num_groups=3"], "model.num_experts"),
    (["model.first_k_dense=9"], "model.first_k_dense"),
    (["run.steps=0"], "run.steps"),
    (["model.score_func=relu"], "model.score_func"),
    (["model.num_layers=two"], "model.num_layers"),
    (["run.steps=2.5"], "run.steps"),
    (["checkpoint.resume=maybe"], "checkpoint.resume"),
    (["model.fp8=e5m2"], "model.fp8"),
    (["model.fp8=blockwise", "model.moe_ffn_hidden_size=200"], "model.fp8"),  # 200 not a multiple of 16
    (["model.fp8=tensorwise", "model.moe_ffn_hidden_size=256", "parallel.etp=32"], "model.fp8"),  # 8 per ETP rank
    (["optimizer.lr=1e-4", "optimizer.min_lr=1e-3"], "optimizer.min_lr"),
    (["optimizer.lr=0"], "optimizer.lr"),
    (["checkpoint.interval=-1"], "checkpoint.interval"),
    (["checkpoint.keep_last=-1"], "checkpoint.keep_last"),
    (["optimizer.beta1=1"], "optimizer.beta1"),
    (["optimizer.beta1=-0.1"], "optimizer.beta1"),
    (["optimizer.beta2=1.5"], "optimizer.beta2"),
    (["optimizer.eps=0"], "optimizer.eps"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay"),
    (["optimizer.clip_grad=-1"], "optimizer.clip_grad"),
    (["model.norm_eps=0"], "model.norm_eps"),
    (["model.rope_theta=-1"], "model.rope_theta"),
    (["data.packing_window=0"], "data.packing_window"),
    (["run.nproc=0"], "run.nproc"),
    (["rl.top_p=2"], "rl.top_p"),
    (["rl.top_p=0"], "rl.top_p"),
    (["rl.temperature=-0.5"], "rl.temperature"),
    (["rl.max_new_tokens=0"], "rl.max_new_tokens"),
    (["rl.top_k=-1"], "rl.top_k"),
    (["rl.stop=['', END]"], "rl.stop"),
    (["rl.max_batch=0"], "rl.max_batch"),
    (["rl.prefill_tokens=0"], "rl.prefill_tokens"),
    (["rl.prompts_per_batch=0"], "rl.prompts_per_batch"),
    (["rl.max_new_tokens=128", "rl.max_seq_len=128"], "rl.max_seq_len"),
])
def test_impossible_value_error_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"`{key}"):
        load_config(None, overrides)


@pytest.mark.parametrize("override", ["checkpoint.interval=0", "checkpoint.keep_last=0", "optimizer.clip_grad=0",
                                      "optimizer.weight_decay=0", "optimizer.beta1=0", "rl.temperature=0",
                                      "rl.top_p=1", "data.packing_window=1"])
def test_zero_and_boundary_values_that_mean_something_are_accepted(override):
    load_config(None, [override])  # 0 means: save only at the end, keep every checkpoint, no clipping, greedy, ...


def test_parallel_layout_is_checked_against_the_world_size():
    cfg = load_config(None, ["parallel.tp=2", "parallel.ep=4"])
    validate(cfg, world_size=8)
    with pytest.raises(ConfigError, match="world size 6"):
        validate(cfg, world_size=6)


def test_malformed_override_and_missing_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["model.num_layers"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "model: [unclosed\n"))


def test_the_repository_has_the_tiny_and_model_shaped_configs():
    assert {p.stem for p in CONFIGS} >= {"tiny", "mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v3"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_in_configs_loads_and_its_layer_count_can_be_overridden(path):
    cfg = load_config(path)
    fewer = max(cfg.model.first_k_dense + 1, 2)
    assert load_config(path, [f"model.num_layers={fewer}"]).model.num_layers == fewer


def test_model_shaped_configs_carry_the_published_shapes():
    q = load_config(CONFIGS[0].with_name("qwen3_30b_a3b.yaml")).model
    assert (q.hidden_size, q.num_layers, q.num_heads, q.num_kv_heads, q.kv_channels) == (2048, 48, 32, 4, 128)
    assert (q.num_experts, q.top_k, q.moe_ffn_hidden_size, q.vocab_size) == (128, 8, 768, 151936)
    assert q.score_func == "softmax" and q.norm_topk_prob
    m = load_config(CONFIGS[0].with_name("mixtral_8x7b.yaml")).model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads) == (4096, 32, 32, 8)
    assert (m.num_experts, m.top_k, m.moe_ffn_hidden_size, m.vocab_size) == (8, 2, 14336, 32000)
    d = load_config(CONFIGS[0].with_name("deepseek_v3.yaml")).model
    assert (d.hidden_size, d.num_layers, d.num_heads, d.first_k_dense, d.ffn_hidden_size) == (7168, 61, 128, 3, 18432)
    assert (d.num_experts, d.top_k, d.moe_ffn_hidden_size, d.shared_expert_ffn_hidden_size) == (256, 8, 2048, 2048)
    assert (d.score_func, d.num_groups, d.topk_groups, d.routed_scaling_factor) == ("sigmoid", 8, 4, 2.5)
    assert (d.bias_update_rate, d.aux_loss_type, d.vocab_size) == (1e-3, "sequence", 129280)
    assert (d.attention, d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == (
        "mla", 1536, 512, 128, 64, 128)
    assert (d.rope_scaling_factor, d.rope_original_max_position, d.rope_beta_fast, d.rope_beta_slow, d.rope_mscale,
            d.rope_mscale_all_dim) == (40.0, 4096, 32.0, 1.0, 1.0, 1.0)


def test_tiny_config_is_a_cpu_run_that_checkpoints_every_50_steps():
    cfg = load_config(CONFIGS[0].with_name("tiny.yaml"))
    assert (cfg.run.device, cfg.run.nproc, cfg.checkpoint.interval, cfg.data.tokenizer) == ("cpu", 1, 50, "byte")
    assert cfg.model.num_experts == 8 and cfg.model.top_k == 2 and cfg.data.seq_len == 256
