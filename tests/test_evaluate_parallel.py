"""`foldmoe evaluate ... run.nproc=N`: a checkpoint evaluated over N ranks in a folded layout gives the one-process figure.

Specification: torchrun starts N gloo ranks; each builds its slices of the layout (EP over the data-parallel ranks; TP
with sequence parallelism and two pipeline stages) and reads its boxes of a checkpoint one process saved. Over a corpus
whose micro-batches do not fill the last round of data-parallel ranks (a rank runs a copy with no loss token), over the
held-out set, and with --max-tokens, the loss equals the one-process evaluation's within 1e-5 relative (fp32, sums in
another order) and the loss tokens and sequences are the same; rank 0 alone prints the result. An HF model directory
is refused over several ranks, naming the fix.
"""

from __future__ import annotations

import json

import pytest

from services.checkpointer.convert import main as convert
from services.cli import main as cli
from test_checkpointer_convert_cli import TINY
from test_evaluate import corpus
from test_generate import ckpt  # noqa: F401  (the module's trained checkpoint)

LAYOUTS = {"ep2": ["run.nproc=2", "parallel.ep=2"], "tp2xpp2": ["run.nproc=4", "parallel.tp=2", "parallel.pp=2"]}


def evaluate(capfd, *argv) -> tuple[int, list[dict], str]:
    """(exit code, the JSON results printed, standard error) of `foldmoe evaluate ARGV --json` (the ranks are
    processes of their own: their output is read from the file descriptors)."""
    capfd.readouterr()
    code = cli(["evaluate", *map(str, argv), "--json", "run.device=cpu", "data.seq_len=64"])
    out, err = capfd.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_corpus_over_a_folded_layout_gives_the_one_process_loss(ckpt, capfd, tmp_path, layout):  # noqa: F811
    # micro-batches of one sequence, an odd number of them: the last round of two data-parallel ranks has one
    args = ["--checkpoint", ckpt[0], "--corpus", corpus(tmp_path), f"run.dir={tmp_path}", "data.micro_batch_size=1"]
    code, [one], err = evaluate(capfd, *args)
    assert code == 0, err
    assert one["sequences"] % 2 == 1
    code, results, err = evaluate(capfd, *args, *LAYOUTS[layout])
    assert code == 0, err
    assert len(results) == 1, err  # rank 0 reports
    [folded] = results
    assert (folded["tokens"], folded["sequences"]) == (one["tokens"], one["sequences"])
    assert folded["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert f"over {LAYOUTS[layout][0].removeprefix('run.nproc=')} ranks" in err


def test_the_held_out_set_and_a_token_cap_over_ranks_give_the_one_process_figures(ckpt, capfd, tmp_path):  # noqa: F811
    held_out = ["--config", TINY, f"data.dataset_dir={tmp_path / 'data'}"]  # tiny.yaml's: 5% of the licence texts
    for extra in (held_out, ["--corpus", corpus(tmp_path), "--max-tokens", "100", "data.micro_batch_size=1"]):
        args = ["--checkpoint", ckpt[0], f"run.dir={tmp_path}", *extra]
        code, [one], err = evaluate(capfd, *args)
        assert code == 0, err
        code, [folded], err = evaluate(capfd, *args, *LAYOUTS["ep2"])
        assert code == 0, err
        assert (folded["tokens"], folded["sequences"]) == (one["tokens"], one["sequences"])
        assert folded["loss"] == pytest.approx(one["loss"], rel=1e-5)
        if extra != held_out:
            assert 100 <= folded["tokens"] and folded["sequences"] < 5  # stopped early, after the same micro-batch


def test_an_hf_directory_over_several_ranks_is_refused_naming_the_fix(ckpt, capfd, tmp_path):  # noqa: F811
    hf = tmp_path / "hf"
    assert convert(["export", str(ckpt[0]), str(hf), "--family", "mixtral"]) == 0
    code, _, err = evaluate(capfd, "--checkpoint", hf, "--corpus", corpus(tmp_path), f"run.dir={tmp_path}",
                            *LAYOUTS["ep2"])
    assert code == 2
    assert "is an HF model directory, which one process evaluates" in err and "convert import" in err
