"""`foldmoe generate`: completions of prompts by a trained checkpoint.

Specification: greedy completions are those of an argmax loop over the model's full forward (no cache) with the fp32
master weights the checkpoint holds, for every prompt (an empty one starting from the end-of-document token), printed
in prompt order; an HF directory exported from that checkpoint generates the same; sampling is reproducible by
--seed; the tokenizer is the one the run trained with unless --tokenizer names another with the same content; bad
input (no checkpoint, another tokenizer, sampling values out of range, an unreadable prompts file) is one line naming
the cause, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.checkpointer.convert import main as convert
from services.cli import main as cli
from services.common.config import load_config
from services.common.tokenizer import ByteTokenizer
from services.rl_rollout.worker import rollout_model_config
from services.trainer.model.transformer import MoETransformer
from test_checkpointer_convert_cli import TINY, trained
from test_tokenizer import _write_hf_tokenizer

PROMPTS = ["GNU GENERAL PUBLIC LICENSE", "", "Permission is hereby granted"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint.dir the trainer saved into (tiny.yaml, byte tokenizer), and the model's fp32 master weights."""
    root = tmp_path_factory.mktemp("generate") / "ckpt"
    return root, trained(root, [])


def generate(capsys, *argv) -> tuple[int, list[dict], str]:
    """(exit code, the JSON completions printed, standard error) of `foldmoe generate ARGV --json`."""
    capsys.readouterr()
    code = cli(["generate", *map(str, argv), "--json", "run.device=cpu"])  # fp32, as the reference (also on a GPU)
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def greedy_reference(state: dict[str, torch.Tensor], prompt: str, max_tokens: int) -> list[int]:
    model = MoETransformer(rollout_model_config(load_config(TINY).model))
    model.load_state_dict(state)
    model.eval()
    tok = ByteTokenizer()
    tokens, out = tok.encode(prompt) or [tok.eos_id], []
    with torch.no_grad():
        while len(out) < max_tokens and (not out or out[-1] != tok.eos_id):
            ids = torch.tensor(tokens + out)
            logits = model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32))
            out.append(int(logits[-1].argmax()))
    return out


def test_greedy_completions_are_the_full_forwards_argmax_in_prompt_order(ckpt, capsys):
    root, masters = ckpt
    args = ["--checkpoint", root, "--temperature", "0", "--max-tokens", "24"]
    code, done, err = generate(capsys, *args, *[a for p in PROMPTS for a in ("--prompt", p)])
    assert code == 0, err
    assert [(d["prompt_index"], d["sample"], d["prompt"]) for d in done] == [(i, 0, p) for i, p in enumerate(PROMPTS)]
    for d, prompt in zip(done, PROMPTS):
        want = greedy_reference(masters, prompt, 24)
        assert d["token_ids"] == want
        assert d["completion"] == ByteTokenizer().decode(want)
        assert d["finish_reason"] == ("eos" if want[-1] == ByteTokenizer().eos_id else "length")
    assert "step_00000007" in err and "tokens/s" in err  # what was loaded, and the rate


def test_the_text_form_prints_each_prompt_followed_by_its_completion(ckpt, capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Copyright\n\nThe\n")  # blank lines are not prompts
    capsys.readouterr()
    assert cli(["generate", "--checkpoint", str(ckpt[0]), "--prompts", str(prompts), "--temperature", "0",
                "--max-tokens", "8", "run.device=cpu"]) == 0
    blocks = capsys.readouterr().out.split("--- prompt ")[1:]
    assert [b.split("\n", 1)[0].split(",")[0] for b in blocks] == ["1", "2"]
    assert blocks[0].split("\n", 1)[1].startswith("Copyright") and blocks[1].split("\n", 1)[1].startswith("The")


def test_sampling_is_reproducible_by_seed_with_samples_per_prompt(ckpt, capsys):
    args = ["--checkpoint", ckpt[0], "--prompt", "The", "--prompt", "A", "--samples", "3", "--max-tokens", "32",
            "--temperature", "1.5"]
    code, first, _ = generate(capsys, *args, "--seed", "3")
    _, again, _ = generate(capsys, *args, "--seed", "3")
    _, other, _ = generate(capsys, *args, "--seed", "4")
    assert code == 0 and first == again
    assert [(d["prompt_index"], d["sample"]) for d in first] == [(i, j) for i in range(2) for j in range(3)]
    assert [d["token_ids"] for d in first] != [d["token_ids"] for d in other]
    assert len({tuple(d["token_ids"]) for d in first}) > 1  # the samples of a prompt are drawn apart


def test_an_hf_directory_exported_from_the_checkpoint_generates_the_same(ckpt, capsys, tmp_path):
    hf = tmp_path / "hf"
    assert convert(["export", str(ckpt[0]), str(hf), "--family", "mixtral", "--dtype", "float32"]) == 0
    args = ["--temperature", "0", "--max-tokens", "16", "--prompt", PROMPTS[0]]
    _, ours, _ = generate(capsys, "--checkpoint", ckpt[0], *args)
    code, theirs, err = generate(capsys, "--checkpoint", hf, *args)  # no tokenizer.json: data.tokenizer (byte)
    assert code == 0, err
    assert theirs == ours and f"HF model {hf}" in err
    from test_dataloader_chat import CHATML
    chat = ["--chat", "--max-tokens", "4"]
    (hf / "tokenizer_config.json").write_text("{not json")
    code, _, err = generate(capsys, "--checkpoint", hf, *chat)
    assert code == 2 and "tokenizer_config.json cannot be read as JSON" in err
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "comment": "no chat_template here"}))
    code, _, err = generate(capsys, "--checkpoint", hf, *chat)
    assert code == 2 and "--chat renders prompts with a chat template" in err
    (hf / "chat_template.jinja").write_text(CHATML)  # where newer transformers save it
    code, done, err = generate(capsys, "--checkpoint", hf, *chat, "--prompt", "2+2?")
    assert code == 0 and done[0]["prompt"] == "2+2?", err
    pytest.importorskip("tokenizers", reason="HF tokenizers need the `tokenizers` package (in the test extras)")
    _write_hf_tokenizer(hf / "tokenizer.json")  # the directory's own tokenizer, of 300 ids: not this model's
    code, _, err = generate(capsys, "--checkpoint", hf, *args)
    assert code == 2 and "300 ids" in err and "vocabulary of 264" in err


def test_another_tokenizer_than_the_trained_one_is_refused(ckpt, capsys, tmp_path):
    pytest.importorskip("tokenizers", reason="HF tokenizers need the `tokenizers` package (in the test extras)")
    narrow = _write_hf_tokenizer(tmp_path / "narrow.json", vocab_size=260)  # fits the 264 ids, but is not bytes
    code, _, err = generate(capsys, "--checkpoint", ckpt[0], "--tokenizer", narrow)
    assert code == 2 and "is not the tokenizer" in err and "data.tokenizer=byte" in err
    code, done, _ = generate(capsys, "--checkpoint", ckpt[0], "--tokenizer", "byte", "--max-tokens", "2")
    assert code == 0 and len(done) == 1  # the same tokenizer, named


@pytest.mark.parametrize("argv, names", [
    (["--checkpoint", "{empty}"], "holds no committed checkpoint"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--samples", "0"], "--samples must be at least 1"),
    (["--max-tokens", "0"], "max_tokens >= 1"),
    (["--prompts", "{missing}"], "cannot read prompts"),
])
def test_bad_input_is_one_line_naming_the_cause(ckpt, capsys, tmp_path, argv, names):
    (tmp_path / "empty").mkdir()
    fill = {"{empty}": str(tmp_path / "empty"), "{missing}": str(tmp_path / "missing.txt")}
    argv = [fill.get(a, a) for a in argv]
    if "--checkpoint" not in argv:
        argv += ["--checkpoint", str(ckpt[0])]
    code, done, err = generate(capsys, *argv)
    lines = [line for line in err.splitlines() if line.startswith("foldmoe generate: error:")]
    assert code == 2 and not done and len(lines) == 1 and names in lines[0], err


def test_jsonl_prompts_scored_by_a_reward_give_their_mean(ckpt, capsys, tmp_path, monkeypatch):
    root, masters = ckpt
    right = ByteTokenizer().decode(greedy_reference(masters, "Copyright", 6)).strip()
    records = tmp_path / "eval.jsonl"
    records.write_text(json.dumps({"prompt": "Copyright", "answer": right}) + "\n"
                       + json.dumps({"prompt": "Copyright", "answer": right + "x"}) + "\n")
    args = ["--checkpoint", root, "--prompts", records, "--temperature", "0", "--max-tokens", "6"]
    code, done, err = generate(capsys, *args, "--reward", "exact")
    assert code == 0, err
    assert [d["reward"] for d in done] == [1.0, 0.0] and "mean reward 0.5000 over 2 completions (exact)" in err
    code, _, err = generate(capsys, "--checkpoint", root, "--prompt", "Copyright", "--reward", "exact")
    assert code == 2 and "give the prompts as a .jsonl file" in err  # no answer to compare with
    (tmp_path / "broken_reward.py").write_text("def score(prompt, completion, meta):\n    return meta['missing']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = generate(capsys, *args, "--reward", "broken_reward:score")
    assert code == 2 and "--reward broken_reward:score failed on prompt 1: KeyError" in err
    records.write_text('{"prompt": "Copyright"}\n')
    code, _, err = generate(capsys, *args, "--reward", "number")
    assert code == 2 and "--prompts: " in err and "eval.jsonl:1 has no \"answer\"" in err


def test_chat_renders_each_prompt_as_a_user_turn_of_the_trained_template(capsys, tmp_path):
    from services.dataloader.chat import ChatTemplate
    from services.rl_rollout.generate import as_chat
    from test_dataloader_chat import CHATML

    chatml = ChatTemplate("chatml", CHATML)
    rendered, end = as_chat([("2+2?", {"answer": 4})], chatml)
    assert rendered == [("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", {"answer": 4})]
    assert end == "<|im_end|>"  # what ends an assistant turn: the stop string
    assert as_chat([("q", {})], ChatTemplate("bare", "{% for m in messages %}{{ m.content }}{% endfor %}"))[1] == ""

    (tmp_path / "chatml.jinja").write_text(CHATML)
    root = tmp_path / "ckpt"
    masters = trained(root, [f"data.chat_template={tmp_path / 'chatml.jinja'}"])  # the run records its template
    code, done, err = generate(capsys, "--checkpoint", root, "--chat", "--prompt", "2+2?", "--temperature", "0",
                               "--max-tokens", "24")
    assert code == 0, err
    want = greedy_reference(masters, rendered[0][0], 24)
    assert done[0]["prompt"] == "2+2?" and done[0]["token_ids"] == want[:len(done[0]["token_ids"])]
    assert done[0]["finish_reason"] == "stop" or len(done[0]["token_ids"]) == len(want)
    trained(tmp_path / "plain", [])  # a run without a template
    code, _, err = generate(capsys, "--checkpoint", tmp_path / "plain", "--chat")
    assert code == 2 and "--chat renders prompts with a chat template" in err
