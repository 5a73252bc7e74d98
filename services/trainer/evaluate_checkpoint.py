"""`foldmoe evaluate`: a checkpoint's (or an HF model's) loss and perplexity on a corpus, or on its run's held-out set.

    foldmoe evaluate [--config FILE] [--checkpoint SPEC] [--corpus PATH]... [--max-tokens N] [--tokenizer SPEC]
                     [--json] [section.key=value ...]

The model loads as `foldmoe generate` loads it (services/rl_rollout/generate.py `load_model`): a committed checkpoint,
a checkpoint.dir (its newest valid one; default the config's) or an HF model directory, with the tokenizer it was
trained with, on `run.device` (bf16 on a GPU under run.dtype=bf16, else fp32), every expert keeping every token.
With `run.nproc=N` > 1, N ranks under torchrun evaluate a checkpoint in the folded layout of the config's `parallel`
section, each holding its slices (services/trainer/evaluate_parallel.py), with the same result.

What it reads:
- without --corpus, the config's evaluation set, the one the trainer reports `eval_loss` on (services/dataloader/
  heldout.py: `data.eval_corpus`, or the documents `data.eval_fraction` holds out of `data.corpus`; the first
  `data.eval_micro_batches` x `data.micro_batch_size` sequences). With the run's config, the figure is the trainer's
  `eval_loss` at the checkpoint's step: a check of a checkpoint, or of an HF import against the model it came from.
- with --corpus, every document of those files (any form `data.corpus` takes), tokenized by the model's tokenizer
  into `run.dir/evaluate/<hash of the paths>` (rebuilt when a file changes, as `foldmoe preprocess` rebuilds) and
  packed into sequences of `data.seq_len` as training packs them, each document once; `--max-tokens` stops after that
  many loss tokens.

The loss is the mean cross-entropy over the tokens training would take as targets (a prompt's tokens are none), summed
in fp32, over micro-batches of `data.micro_batch_size` sequences; the perplexity is its exponential. One line on
stdout (or a JSON object with --json); progress on stderr. Bad input is one line naming the cause, exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from rich.console import Console
from rich.progress import Progress

from services.checkpointer.convert import ConvertError, say
from services.checkpointer.hf_families import HFError
from services.checkpointer.layout import CheckpointError
from services.common.command import run_command
from services.common.config import Config, ConfigError, load_config
from services.common.tokenizer import TokenizerError
from services.dataloader.dataset import IndexedDataset
from services.dataloader.errors import DataError
from services.dataloader.heldout import eval_sequences, one_epoch
from services.dataloader.packing import PackedSequences, Sequence
from services.dataloader.preprocess import dataset_paths, ensure_dataset, eval_dataset_path, preprocess
from services.rl_rollout.generate import (GenerateError, Loaded, ModelSource, add_model_arguments, load_model,
                                          open_model)
from services.rl_rollout.worker import rollout_model_config
from services.trainer import evaluate_parallel
from services.trainer.checkpointing import CheckpointLoadError
from services.trainer.parallel.pipeline import loss_forward_pipeline
from services.trainer.train import world_size_from_env

_err = Console(stderr=True)  # progress only


class EvaluateError(ValueError):
    """Input the evaluation cannot use; the message names the cause and the fix."""


@dataclass
class Evaluation:
    loss: float  # mean token cross-entropy
    tokens: int  # loss tokens
    sequences: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


def heldout_set(cfg: Config, loaded: Loaded | ModelSource) -> tuple[list[IndexedDataset], list[Sequence], str]:
    """(datasets, sequences, what they are in words) of the config's evaluation set, as the trainer evaluates."""
    d = cfg.data
    if not d.eval_corpus and d.eval_fraction <= 0:
        raise EvaluateError("the config holds no documents out (data.eval_fraction=0 and no data.eval_corpus): name "
                            "what to evaluate on with --corpus FILE ...")
    ensure_dataset(cfg, progress=_err.is_terminal)  # tokenizes the corpus where the run has not
    identity = loaded.tokenizer.identity()
    whole = bool(d.eval_corpus)
    paths = [eval_dataset_path(cfg)] if whole else dataset_paths(cfg)
    datasets = [IndexedDataset(p, expect_tokenizer=identity) for p in paths]
    sequences = [seq for mb in eval_sequences(datasets, d, whole=whole) for seq in mb]
    what = (f"data.eval_corpus ({', '.join(d.eval_corpus)})" if whole
            else f"the documents data.eval_fraction={d.eval_fraction} holds out of data.corpus")
    return datasets, sequences, what


def corpus_set(cfg: Config, loaded: Loaded | ModelSource,
               corpus: list[str]) -> tuple[list[IndexedDataset], Iterator[Sequence], str]:
    """(the dataset, its sequences, in words) of every document of `corpus`, tokenized by the model's tokenizer."""
    key = hashlib.sha256(json.dumps([str(Path(c).resolve()) for c in corpus]).encode()).hexdigest()[:16]
    out = preprocess(corpus, loaded.tokenizer_spec, Path(cfg.run.dir) / "evaluate" / key,
                     progress=_err.is_terminal, chat_template=loaded.chat_template, option="--corpus")
    dataset = IndexedDataset(out, expect_tokenizer=loaded.tokenizer.identity())
    d = cfg.data
    try:
        source = PackedSequences(dataset.packed_lengths(d.seq_len), d.seq_len, d.packing_window, d.seed)
    except ValueError:
        raise EvaluateError(f"{', '.join(corpus)}: every document is shorter than two tokens: nothing to "
                            "predict") from None
    return [dataset], one_epoch(source), ", ".join(corpus)


def evaluate_loss(loaded: Loaded, datasets: list[IndexedDataset], sequences: Iterator[Sequence] | list[Sequence],
                  seq_len: int, batch: int, max_tokens: int = 0, total: int | None = None) -> Evaluation:
    """The model's mean loss over `sequences`, `batch` sequences a forward; stops once `max_tokens` (> 0) loss tokens
    are counted. `total`: how many sequences there are, for the progress bar (None: unknown)."""
    device = next(loaded.model.parameters()).device
    # summed on the device and read once at the end: the host builds the next micro-batch while the device runs
    loss, seen = torch.zeros((), dtype=torch.float64, device=device), [0, 0]
    start = time.perf_counter()
    with Progress(console=_err, transient=True, disable=not _err.is_terminal) as progress:
        task = progress.add_task("evaluating", total=total)
        for mb in evaluate_parallel.micro_batches(datasets, sequences, seq_len, batch, max_tokens, seen):
            with torch.no_grad():
                loss += loss_forward_pipeline(loaded.model, [mb], device, None, None).double()
            progress.update(task, completed=seen[0])
    count, tokens = seen
    if tokens == 0:
        raise EvaluateError("the sequences hold no loss token (every position a prompt's or padding)")
    return Evaluation(float(loss) / tokens, tokens, count, time.perf_counter() - start)


def evaluation_set(cfg: Config, model: Loaded | ModelSource,
                   corpus: list[str] | None) -> tuple[list[IndexedDataset], Iterator[Sequence] | list[Sequence], str,
                                                      int | None]:
    """(datasets, sequences, what they are in words, how many: None where unknown) of --corpus or the held-out set."""
    if corpus:
        datasets, sequences, what = corpus_set(cfg, model, corpus)
        return datasets, sequences, what, None
    datasets, held, what = heldout_set(cfg, model)
    return datasets, held, what, len(held)


def report(result: Evaluation, args: argparse.Namespace, cfg: Config, source: str, what: str) -> None:
    seq_len = cfg.data.seq_len
    if args.json:
        print(json.dumps({"loss": result.loss, "perplexity": result.perplexity, "tokens": result.tokens,
                          "sequences": result.sequences, "seq_len": seq_len, "model": source, "data": what,
                          "seconds": round(result.seconds, 3)}), flush=True)
    else:
        print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.2f}  over {result.tokens:,} tokens "
              f"({result.sequences} sequences of {seq_len})", flush=True)
    say(f"{result.tokens:,} tokens in {result.seconds:.2f} s ({result.tokens / max(result.seconds, 1e-9):,.0f} "
        "tokens/s)")


def evaluate(args: argparse.Namespace, argv: list[str]) -> Evaluation | None:
    cfg = load_config(args.config, args.overrides)
    if args.max_tokens < 0:
        raise EvaluateError(f"--max-tokens must be >= 0 (0: the whole corpus), got {args.max_tokens}")
    if cfg.run.nproc > 1 and world_size_from_env() == 1:  # this process starts the ranks, which evaluate
        code = subprocess.run(evaluate_parallel.torchrun_command(cfg.run.nproc, argv)).returncode
        if code:
            raise EvaluateError(f"the evaluation over run.nproc={cfg.run.nproc} ranks failed (exit {code}); the "
                                "ranks' errors are above")
        return None
    spec = Path(args.checkpoint or cfg.checkpoint.dir).expanduser()
    if world_size_from_env() > 1:
        return evaluate_over_ranks(args, cfg, spec)
    loaded = load_model(spec, cfg, args.tokenizer)
    datasets, sequences, what, total = evaluation_set(cfg, loaded, args.corpus)
    say(f"evaluating {loaded.source} ({next(loaded.model.parameters()).device}) on {what}, sequences of "
        f"{cfg.data.seq_len}")
    result = evaluate_loss(loaded, datasets, sequences, cfg.data.seq_len, cfg.data.micro_batch_size, args.max_tokens,
                           total)
    report(result, args, cfg, loaded.source, what)
    return result


def evaluate_over_ranks(args: argparse.Namespace, cfg: Config, spec: Path) -> Evaluation:
    """This rank's part of an evaluation over the ranks torchrun started (services/trainer/evaluate_parallel.py);
    rank 0 reports."""
    opened = open_model(spec, cfg, args.tokenizer, torch.float32)  # reads no weight: each rank reads its boxes
    if opened.checkpoint is None:
        raise EvaluateError(f"{spec} is an HF model directory, which one process evaluates (run.nproc=1); to evaluate "
                            "it over several ranks, `python -m services.checkpointer.convert import` it to a "
                            "checkpoint first")
    cfg.model = rollout_model_config(opened.cfg)
    rt, groups = evaluate_parallel.start(cfg)
    try:
        # rank 0 tokenizes what needs it; the others then read it
        datasets, sequences, what, total = evaluate_parallel.rank_zero_first(
            rt, lambda: evaluation_set(cfg, opened, args.corpus))
        model = evaluate_parallel.load_folded_model(cfg, rt, groups, opened.checkpoint)
        shown = rt.rank == 0 and _err.is_terminal
        if rt.rank == 0:
            say(f"evaluating {opened.source} over {rt.world_size} ranks ({rt.device.type}; parallel.tp="
                f"{cfg.parallel.tp} cp={cfg.parallel.cp} pp={cfg.parallel.pp} ep={cfg.parallel.ep} etp="
                f"{cfg.parallel.etp}) on {what}, sequences of {cfg.data.seq_len}")
        with Progress(console=_err, transient=True, disable=not shown) as progress:
            task = progress.add_task("evaluating", total=total)
            loss, tokens, count, seconds = evaluate_parallel.evaluate_folded(
                model, cfg, rt, groups, datasets, sequences, args.max_tokens,
                lambda n: progress.advance(task, n))
        if tokens == 0:
            raise EvaluateError("the sequences hold no loss token (every position a prompt's or padding)")
        result = Evaluation(loss, tokens, count, seconds)
        if rt.rank == 0:
            report(result, args, cfg, opened.source, what)
        return result
    finally:
        torch.distributed.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n")[0].split(": ", 1)[1]
    parser = argparse.ArgumentParser(prog="foldmoe evaluate", description=doc)
    add_model_arguments(parser)
    parser.add_argument("--corpus", action="append", default=None,
                        help="a file, directory or glob pattern to evaluate on, as data.corpus names them (repeat "
                             "for more; default: the config's held-out set)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="stop after this many loss tokens (default 0: every document)")
    parser.add_argument("--json", action="store_true", help="the result as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("foldmoe evaluate", _parser(), argv, lambda args: evaluate(args, argv),
                       (EvaluateError, GenerateError, ConvertError, HFError, ConfigError, CheckpointError,
                        CheckpointLoadError, TokenizerError, DataError, OSError))


if __name__ == "__main__":
    sys.exit(main())
