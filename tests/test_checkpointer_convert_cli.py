"""`python -m services.checkpointer.convert`: HF export / import and upcycling from the command line.

Specification: a checkpoint the trainer saved (bf16 parameters with their fp32 remainders) exports to an HF directory
and imports back to the trainer's exact fp32 master weights; the imported checkpoint verifies, and
`checkpoint.init_from` accepts it and loads it into a fresh model under the config written beside it; an upcycled
dense checkpoint starts an MoE run that computes the dense model's logits; bad input is one line naming the cause and
the fix with exit code 2, and leaves no output behind; an existing output is replaced only with --force.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from services.checkpointer.convert import main
from services.checkpointer.load import load_checkpoint
from services.common.config import load_config
from services.trainer import checkpointing
from services.trainer.model.transformer import MoETransformer
from services.trainer.optim import build_adamw
from test_checkpointer_glue import checkpoint_writer

TINY = "configs/tiny.yaml"
QWEN3 = ["model.qk_norm=true", "model.first_k_dense=1"]  # what Qwen3-MoE computes (mixtral: tiny.yaml as it is)
DENSE = ["model.first_k_dense=4", "model.ffn_hidden_size=256"]  # every layer dense, as wide as tiny.yaml's experts
TOKENS, POS, CU = torch.arange(12) % 250, torch.cat([torch.arange(5), torch.arange(7)]), torch.tensor([0, 5, 12])


class NoData:
    def state(self) -> dict:
        return {}


def trained(ckpt_dir: Path, overrides: list[str]) -> dict[str, torch.Tensor]:
    """tiny.yaml's model after one bf16 optimizer step, saved by the trainer's own path into `ckpt_dir`; returns its
    fp32 master weights (what a resume, and so an export, must see)."""
    cfg = load_config(TINY, overrides)
    cfg.optimizer.param_dtype = "bf16"
    model = MoETransformer(cfg.model)
    model.init_weights(seed=1)
    opt = build_adamw(model, cfg.optimizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(TOKENS, POS, CU.to(torch.int32))
    torch.nn.functional.cross_entropy(logits.float(), TOKENS).backward()
    opt.step()
    with checkpoint_writer(ckpt_dir) as saver:
        checkpointing.save(saver, cfg, model, opt, NoData(), step=7)
        saver.wait(30)
    masters = {n: opt.master_value(p).clone() for n, p in model.named_parameters()}
    return {n: masters.get(n, t) for n, t in model.state_dict().items()}  # + buffers (the routers' expert bias)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """name -> (a checkpoint.dir the trainer saved into, the model's fp32 master weights)."""
    root = tmp_path_factory.mktemp("convert")
    return {name: (root / name, trained(root / name, overrides))
            for name, overrides in (("mixtral", []), ("qwen3_moe", QWEN3), ("dense", DENSE))}


def convert(*argv) -> int:
    return main([str(a) for a in argv])


@pytest.mark.parametrize("family, overrides", [("mixtral", []), ("qwen3_moe", QWEN3)])
def test_export_then_import_gives_the_trained_weights_exactly_and_init_from_loads_them(ckpts, tmp_path, capsys,
                                                                                      family, overrides):
    ckpt, masters = ckpts[family]
    hf, back = tmp_path / "hf", tmp_path / "imported"
    assert convert("export", ckpt, hf, "--family", family, "--dtype", "float32", "--config", TINY, *overrides) == 0
    assert json.loads((hf / "config.json").read_text())["model_type"] == family
    assert (hf / "model.safetensors").is_file()
    recorded = tmp_path / "hf-recorded-config"  # without --config: the model config the checkpoint records
    assert convert("export", ckpt, recorded, "--family", family, "--dtype", "float32") == 0
    assert (recorded / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    assert convert("import", hf, back) == 0
    assert f"checkpoint.init_from={back}" in capsys.readouterr().err

    step = checkpointing.resolve_init_from(str(back))  # verifies every file's sha256
    assert step == back / "step_00000000"
    with load_checkpoint(step) as c:
        assert sorted(c.names()) == sorted(f"model/{n}" for n in masters)
        for name, t in masters.items():
            assert torch.equal(c.read(f"model/{name}"), t), name

    cfg = load_config(back / "model.yaml", [f"checkpoint.init_from={back}", f"checkpoint.dir={tmp_path / 'run'}"])
    # config.json says what the trained model was (the head width explicitly: tiny.yaml's head_dim=0 means 128 / 4)
    assert cfg.model == load_config(TINY, [*overrides, "model.head_dim=32"]).model
    fresh = MoETransformer(cfg.model)
    fresh.init_weights(seed=2)
    assert checkpointing.init_from(cfg, fresh) == step
    cfg.checkpoint.dir = str(back)  # weights only: a run starts from them, it cannot resume them
    with pytest.raises(checkpointing.CheckpointLoadError, match="model weights only .*checkpoint.init_from="):
        checkpointing.restore(cfg, fresh, None, None, rank=0)
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, masters[name]), name


def test_an_upcycled_dense_checkpoint_starts_an_moe_run_computing_the_dense_logits(ckpts, tmp_path):
    ckpt, dense_weights = ckpts["dense"]
    out = tmp_path / "moe"
    assert convert("upcycle", ckpt, out, "--config", TINY) == 0  # tiny.yaml's experts are as wide as the dense MLP
    cfg = load_config(TINY, [f"checkpoint.init_from={out}", f"checkpoint.dir={tmp_path / 'run'}"])
    moe = MoETransformer(cfg.model)
    assert checkpointing.init_from(cfg, moe) == out / "step_00000000"
    assert moe.moe_layers() and moe.moe_layers()[0].experts.w13.shape[0] == 8
    dense = MoETransformer(load_config(TINY, DENSE).model)
    dense.load_state_dict(dense_weights)
    dense.eval(), moe.eval()
    with torch.no_grad():
        torch.testing.assert_close(moe(TOKENS, POS, CU.to(torch.int32)), dense(TOKENS, POS, CU.to(torch.int32)),
                                   rtol=1e-5, atol=1e-5)


def test_an_export_carries_the_runs_tokenizer_and_chat_template(tmp_path):
    """So that the directory loads whole: transformers' AutoTokenizer gives the ids the run trained on and renders the
    run's chat template, its generate stops at the run's end of document; `foldmoe generate` finds the tokenizer there.
    The byte tokenizer has no HF file: none, but its end-of-document id."""
    transformers = pytest.importorskip("transformers")
    from services.common.tokenizer import load_tokenizer
    from services.dataloader.chat import ChatTemplate
    from test_dataloader_chat import CHATML
    from test_tokenizer import TEXT, _write_hf_tokenizer

    (tmp_path / "tok").mkdir()
    tok = _write_hf_tokenizer(tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({  # with a template the run did not train
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<pad>",
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}))
    (tmp_path / "chatml.jinja").write_text(CHATML)
    trained(tmp_path / "ckpt", ["model.vocab_size=304", f"data.tokenizer={tok}",
                                f"data.chat_template={tmp_path / 'chatml.jinja'}"])
    out = tmp_path / "hf"
    assert convert("export", tmp_path / "ckpt", out, "--family", "mixtral") == 0
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert (out / "chat_template.jinja").read_text() == CHATML  # the run's, the only one there
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.encode(TEXT, add_special_tokens=False) == load_tokenizer(str(tok)).encode(TEXT)
    turn = [{"role": "user", "content": "2+2?"}]
    assert theirs.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) == ChatTemplate(
        "chatml", CHATML).render(turn, add_generation_prompt=True)

    # generate stops at the run's end of document: its id in config.json and generation_config.json
    ends = transformers.GenerationConfig.from_pretrained(out)
    assert (ends.eos_token_id, ends.pad_token_id) == (0, 1)  # <|endoftext|>, <pad>: the first two of that tokenizer
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0

    trained(tmp_path / "bytes", [])
    assert convert("export", tmp_path / "bytes", tmp_path / "hf_bytes", "--family", "mixtral") == 0
    assert sorted(p.name for p in (tmp_path / "hf_bytes").iterdir()) == ["config.json", "generation_config.json",
                                                                         "model.safetensors"]
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf_bytes").eos_token_id == 256  # the byte EOS


def bad_inputs(ckpts: dict, tmp: Path) -> list[tuple[list, str]]:
    mixtral, dense = ckpts["mixtral"][0], ckpts["dense"][0]
    gpt2 = tmp / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_hidden_layers": 2}))
    partial = tmp / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps({"model_type": "mixtral", "vocab_size": 264}))
    out = tmp / "out"
    return [
        (["export", tmp / "missing", out, "--family", "mixtral"], r"missing: no such directory; name a checkpoint"),
        (["export", gpt2, out, "--family", "mixtral"], r"holds no committed checkpoint that verifies; name a"),
        (["export", mixtral, out, "--family", "mixtral", "--config", TINY, "model.hidden_size=64"],
         r"holds another model than the model config describes: 'embed.weight' is \[264, 128\] there but "
         r"\[264, 64\] .*model.hidden_size=128 there, 64 here"),
        (["export", mixtral, out, "--family", "gpt2", "--config", TINY],
         r"unknown HF family 'gpt2'; choose one of mixtral, qwen3_moe, qwen2_moe, deepseek_v3, deepseek_v2, qwen3, qwen2, "
         r"llama, "
         r"mistral"),
        (["export", mixtral, out, "--family", "llama", "--config", TINY],
         r"llama is a dense model: it needs `model.first_k_dense=model.num_layers` \(4\), got 0; export MoE models"),
        (["export", mixtral, out, "--family", "qwen3_moe", "--config", TINY],
         r"qwen3_moe has per-head q/k RMSNorm: it needs `model.qk_norm=true`"),
        (["export", mixtral, out, "--family", "mixtral", "--config", tmp / "nope.yaml"],
         r"config file .* does not exist"),
        (["import", tmp / "missing", out], r"missing: no such directory; point at an HF model directory"),
        (["import", tmp, out], r"config.json is missing; point at an HF model directory"),
        (["import", gpt2, out], r"model_type 'gpt2' is not supported: only models of the families mixtral, .* "
                                r"\(the dense ones, qwen3, qwen2, llama, mistral, to upcycle\)"),
        (["import", partial, out], r"config.json has no 'num_hidden_layers' field: not a complete HF model config"),
        (["upcycle", mixtral, out, "--config", TINY], r"is an MoE model .*upcycle starts from a dense one"),
        (["upcycle", dense, out, "--config", TINY, "model.moe_ffn_hidden_size=128"],
         r"experts copy the dense MLP: need `model.moe_ffn_hidden_size=256` \(the dense ffn_hidden_size\), got 128"),
        (["upcycle", dense, out, "--config", TINY, "model.qk_norm=true"],
         r"upcycled dense checkpoint .* has no 'layers.0.attn.k_norm.weight' .*"
         r"keeps the dense model's model.qk_norm=false$"),
    ]


def test_bad_input_is_one_line_naming_the_cause_and_the_fix_and_writes_nothing(ckpts, tmp_path, capsys):
    for argv, message in bad_inputs(ckpts, tmp_path):
        assert convert(*argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("convert: error: "), err
        assert re.search(message, last), (argv, last)
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*")), argv


def test_a_damaged_file_is_refused_naming_it(ckpts, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert convert("export", ckpts["mixtral"][0], hf, "--family", "mixtral", "--config", TINY) == 0
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    assert convert("import", hf, tmp_path / "imported") == 2
    assert f"convert: error: {weights} cannot be read as safetensors" in capsys.readouterr().err

    ckpt = tmp_path / "step_00000007"
    shutil.copytree(ckpts["mixtral"][0] / "step_00000007", ckpt)
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-8])
    assert convert("export", ckpt, tmp_path / "hf2", "--family", "mixtral", "--config", TINY) == 2
    assert f"convert: error: {shard} has" in capsys.readouterr().err
    assert not (tmp_path / "imported").exists() and not (tmp_path / "hf2").exists()


def test_an_existing_output_is_replaced_only_with_force_and_kept_when_the_conversion_fails(ckpts, tmp_path, capsys):
    ckpt = ckpts["mixtral"][0]
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert convert("export", ckpt, out, "--family", "mixtral", "--config", TINY) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert convert("export", ckpt, out, "--family", "mixtral", "--config", TINY, "--force",
                   "model.num_layers=3") == 2  # fails after the output was staged: the old one stays
    assert (out / "mine.txt").read_text() == "keep me" and not list(tmp_path.glob(".hf.*"))
    assert convert("export", ckpt, out, "--family", "mixtral", "--config", TINY, "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".hf.*"))
    assert convert("export", ckpt, ckpt.parent, "--family", "mixtral", "--config", TINY, "--force") == 2
    assert "holds the input" in capsys.readouterr().err
