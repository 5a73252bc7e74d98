"""`foldmoe evaluate`: a checkpoint's loss and perplexity on a corpus.

Specification: over --corpus files, the loss is the mean cross-entropy of the model's fp32 master weights over every
target token of every document, each document once (packed sequences with document masking give what each document
alone gives; a plain document longer than a sequence in the pieces training packs it as, an example cut to its first
`data.seq_len` positions, a prompt's tokens no targets), the perplexity its exponential; --max-tokens stops early; an
HF directory exported from the checkpoint gives the same figure; bad input (a missing corpus, no held-out documents, a
negative token cap, no checkpoint) is one line naming the cause, exit 2. (That the held-out figure is the trainer's
`eval_loss` is checked on a real run in tests/test_launcher_end_to_end.py.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from services.checkpointer.convert import main as convert
from services.cli import main as cli
from services.common.config import load_config
from services.common.tokenizer import ByteTokenizer
from services.rl_rollout.worker import rollout_model_config
from services.trainer.model.transformer import MoETransformer
from test_checkpointer_convert_cli import TINY
from test_generate import ckpt  # noqa: F401  (the module's trained checkpoint)

SEQ_LEN = 64
TEXTS = ["GNU GENERAL PUBLIC LICENSE", "Permission is hereby granted, free of charge",
         "x" * 150]  # the last: three pieces of at most 64 positions
EXAMPLES = [{"prompt": "Q: what is 2+2? A:" * 2, "completion": " four, and then some more words, and more again."}]
# (36 prompt tokens, 49 completion tokens with EOS: cut to its first 64 positions, 29 of them targets)


def run(capsys, *argv) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = cli(["evaluate", *map(str, argv), "--json", "run.device=cpu", f"data.seq_len={SEQ_LEN}",
                "data.micro_batch_size=2"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"text": t} for t in TEXTS] + EXAMPLES))
    return path


def reference(masters: dict[str, torch.Tensor]) -> tuple[float, int]:
    """(summed token loss, loss tokens) of each document alone, in the pieces packing makes of it."""
    model = MoETransformer(rollout_model_config(load_config(TINY).model))
    model.load_state_dict(masters)
    model.eval()
    tok = ByteTokenizer()
    docs = [(tok.encode(t) + [tok.eos_id], None) for t in TEXTS]
    for r in EXAMPLES:
        prompt, completion = tok.encode(r["prompt"]), tok.encode(r["completion"]) + [tok.eos_id]
        targets = [False] * len(prompt) + [True] * len(completion)
        docs.append(((prompt + completion)[:SEQ_LEN + 1], targets[:SEQ_LEN + 1]))  # an example is cut, not split
    total, count = 0.0, 0
    for ids, targets in docs:
        for s in range(0, len(ids) - 1, SEQ_LEN):
            piece = torch.tensor(ids[s:s + SEQ_LEN + 1])
            keep = torch.ones(len(piece) - 1, dtype=torch.bool) if targets is None else \
                torch.tensor(targets[s + 1:s + len(piece)])
            with torch.no_grad():
                logits = model(piece[:-1], torch.arange(len(piece) - 1),
                               torch.tensor([0, len(piece) - 1], dtype=torch.int32))
            losses = torch.nn.functional.cross_entropy(logits.float(), piece[1:], reduction="none")
            total += float(losses[keep].sum())
            count += int(keep.sum())
    return total, count


def test_the_corpus_loss_is_each_documents_own_mean_over_its_targets(ckpt, capsys, tmp_path):  # noqa: F811
    root, masters = ckpt
    total, count = reference(masters)
    code, result, err = run(capsys, "--checkpoint", root, "--corpus", corpus(tmp_path), f"run.dir={tmp_path / 'run'}")
    assert code == 0, err
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(total / count, rel=1e-5)  # fp32 sums in another order
    assert result["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert result["seq_len"] == SEQ_LEN and f"checkpoint {root}" in result["model"]
    assert (tmp_path / "run" / "evaluate").is_dir()  # the tokenized corpus, kept for the next evaluation

    hf = tmp_path / "hf"  # the same model, exported
    assert convert(["export", str(root), str(hf), "--family", "mixtral", "--dtype", "float32"]) == 0
    code, exported, err = run(capsys, "--checkpoint", hf, "--corpus", corpus(tmp_path), f"run.dir={tmp_path / 'run'}")
    assert code == 0, err
    assert exported["tokens"] == count and exported["loss"] == pytest.approx(result["loss"], rel=1e-6)


def test_max_tokens_stops_early(ckpt, capsys, tmp_path):  # noqa: F811
    code, whole, _ = run(capsys, "--checkpoint", ckpt[0], "--corpus", corpus(tmp_path), f"run.dir={tmp_path}")
    code, capped, err = run(capsys, "--checkpoint", ckpt[0], "--corpus", corpus(tmp_path), "--max-tokens", "10",
                            f"run.dir={tmp_path}")
    assert code == 0, err
    assert 10 <= capped["tokens"] < whole["tokens"] and capped["sequences"] == 2  # one micro-batch of two


def test_the_text_form_is_one_line(ckpt, capsys, tmp_path):  # noqa: F811
    capsys.readouterr()
    code = cli(["evaluate", "--checkpoint", str(ckpt[0]), "--corpus", str(corpus(tmp_path)), "run.device=cpu",
                f"run.dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("loss ") and " perplexity " in out and len(out.splitlines()) == 1
    assert "tokens/s" in err


@pytest.mark.parametrize("argv, names", [
    (["--corpus", "{missing}"], "corpus entry '{missing}' does not exist; fix `--corpus`"),
    (["--corpus", "{tmp}/*.nope"], "/*.nope' matches no file; fix `--corpus`"),
    (["data.eval_fraction=0"], "holds no documents out"),
    (["--max-tokens", "-1"], "--max-tokens must be >= 0"),
    (["--checkpoint", "{tmp}"], "holds no committed checkpoint"),
])
def test_bad_input_is_one_line_naming_the_cause(ckpt, capsys, tmp_path, argv, names):  # noqa: F811
    fill = {"{missing}": str(tmp_path / "missing.txt"), "{tmp}": str(tmp_path)}
    argv = [fill.get(a, a.replace("{tmp}", str(tmp_path))) for a in argv]
    if "--checkpoint" not in argv:
        argv += ["--checkpoint", str(ckpt[0])]
    code, _, err = run(capsys, *argv, f"run.dir={tmp_path}")
    lines = [line for line in err.splitlines() if line.startswith("foldmoe evaluate: error:")]
    names = names.replace("{missing}", fill["{missing}"])
    assert code == 2 and len(lines) == 1 and names in lines[0], err
