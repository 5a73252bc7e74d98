"""`foldmoe generate`: completions of prompts by a trained model, with the rollout engine.

    foldmoe generate [--config FILE] [--checkpoint CKPT] [--prompt TEXT ...] [--prompts FILE] [--samples N]
                     [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--stop TEXT ...] [--seed N]
                     [--chat] [--reward NAME] [--tokenizer SPEC] [--json] [section.key=value ...]

CKPT is a committed checkpoint (a step_NNNNNNNN directory), a `checkpoint.dir` (its newest checkpoint that verifies;
default: the config's) or a Hugging Face model directory (config.json + *.safetensors, read as `convert import` does).
The model is the one the checkpoint records; its weights are the fp32 master weights a resume would see, run in bf16
on a GPU (`run.device`, `run.dtype`) and fp32 on the CPU. The tokenizer is the one the run that wrote the checkpoint
trained with (its recorded `data.tokenizer`), an HF directory's tokenizer.json, or `--tokenizer`.

Generation is the RL workers' engine (services/rl_rollout/engine.py: KV cache, continuous batching, chunked prefill)
and sampler: temperature 0 is greedy. An empty prompt starts from the end-of-document token, where every packed
document of the training stream starts. Completions print in prompt order as they finish, the prompt followed by its
completion; `--json` prints one JSON object per line instead. Bad input is one line naming the cause and the fix,
exit 2.

With `--chat` each prompt is a user turn, rendered by the chat template the model was trained with (its run's
`data.chat_template`, an HF directory's tokenizer_config.json or chat_template.jinja) with the generation prompt, and a
completion stops at the text that ends the assistant's turn.

Prompts from a `.jsonl` file are records as `rl.prompts` reads them (services/rl_rollout/prompts.py: a "prompt" and
the reward's fields, e.g. "answer"); `--reward` (a registered reward such as `number` or `exact`, or module:function)
scores each completion against its record, and the mean reward is printed: a policy's evaluation, offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from services.checkpointer.convert import (ConvertError, check_fits, find_checkpoint, iter_model_state, recorded_config,
                                           say, trained_config)
from services.checkpointer.hf import items, open_hf
from services.checkpointer.hf_families import HFError
from services.checkpointer.layout import CheckpointError
from services.common.command import run_command
from services.common.config import Config, ConfigError, ModelConfig, load_config
from services.common.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from services.dataloader.chat import ChatTemplate, hf_chat_template, load_chat_template
from services.dataloader.errors import DataError
from services.rl_rollout.engine import Completion, Engine, EngineError, Request
from services.rl_rollout.prompts import ANSWER_CHECKS, Prompt, load_reward, read_records
from services.rl_rollout.rewards import RewardFn
from services.rl_rollout.sampling import SamplingParams
from services.rl_rollout.worker import rollout_device, rollout_model_config
from services.trainer.model.initial_weights import materialize, parameters_on_meta
from services.trainer.model.transformer import MoETransformer

MAX_BATCH = 64  # sequences decoding together at most (KV cache slots)
_err = Console(stderr=True)  # progress only


class GenerateError(ValueError):
    """Input generation cannot use; the message names the cause and the fix."""


def _is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and not (path / "manifest.json").is_file()


def _tokenizer(given: str | None, recorded: str | None, fallback: str, source: str) -> Tokenizer:
    """`given` (--tokenizer), else the one the checkpoint was trained with, else `fallback` (data.tokenizer).
    A given tokenizer other than the recorded one (by content, where the recorded file can still be read) is
    refused: ids mean nothing under another vocabulary."""
    if given is None:
        spec = recorded or fallback
        try:
            return load_tokenizer(spec)
        except TokenizerError as e:
            if recorded:
                raise GenerateError(f"{source} was trained with data.tokenizer={recorded}, which cannot be loaded "
                                    f"here ({e}); pass the same tokenizer with --tokenizer") from None
            raise
    tokenizer = load_tokenizer(given)
    if recorded and recorded != given:
        try:
            trained_with = load_tokenizer(recorded)
        except TokenizerError:
            say(f"warning: {source} was trained with data.tokenizer={recorded}, which cannot be read here to "
                 f"compare with --tokenizer {given}")
            return tokenizer
        if trained_with.identity() != tokenizer.identity():
            raise GenerateError(f"--tokenizer {given} is not the tokenizer {source} was trained with "
                                f"(data.tokenizer={recorded}: {trained_with.identity()} against "
                                f"{tokenizer.identity()}); drop --tokenizer to use the recorded one")
    return tokenizer


@dataclass
class ModelSource:
    """A model to load, opened but not read: its config, tokenizer and chat template, and its weights to be read."""
    cfg: ModelConfig  # as trained (or as config.json describes it)
    tokenizer: Tokenizer
    tokenizer_spec: str  # what `tokenizer` was loaded from ("byte", a tokenizer.json)
    source: str  # what is loaded, in words
    chat_template: str  # the chat template the model was trained with (data.chat_template, an HF directory's); ""
    checkpoint: Path | None  # the foldmoe checkpoint (None: an HF model directory)
    state: Iterable[tuple[str, torch.Tensor]]  # (name, value) of every parameter and saved buffer, read as iterated


@dataclass
class Loaded:
    model: MoETransformer  # on `run.device`, in eval mode
    tokenizer: Tokenizer
    tokenizer_spec: str
    source: str
    chat_template: str


def open_model(spec: Path, cfg: Config, tokenizer_spec: str | None, dtype: torch.dtype) -> ModelSource:
    """A foldmoe checkpoint or an HF model directory (its weights to be read in `dtype`), with the tokenizer it was
    trained with (`tokenizer_spec` where given; refused where it is wider than the model's vocabulary)."""
    if _is_hf_directory(spec):
        hf = open_hf(spec, dtype)  # read in the model's dtype
        model_cfg, source, checkpoint = hf.cfg, f"HF model {spec}", None
        check_fits(hf.shapes(), model_cfg, source, "; its config.json does not describe the tensors beside it")
        bundled = spec / "tokenizer.json"
        recorded = str(bundled) if bundled.is_file() else None
        chat_template = hf_chat_template(spec)
        state = items(hf.state())
    else:
        checkpoint = find_checkpoint(spec)
        model_cfg = trained_config(checkpoint)
        source = f"checkpoint {checkpoint}"
        data = recorded_config(checkpoint).get("data") or {}
        recorded, chat_template = data.get("tokenizer"), data.get("chat_template") or ""
        state = iter_model_state(checkpoint, model_cfg)  # read once the tokenizer is known to fit
    tokenizer = _tokenizer(tokenizer_spec, recorded, cfg.data.tokenizer, source)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise GenerateError(f"the tokenizer has {tokenizer.vocab_size} ids but the model of {source} has a vocabulary "
                            f"of {model_cfg.vocab_size}: not the tokenizer it was trained with; pass that one with "
                            "--tokenizer")
    return ModelSource(model_cfg, tokenizer, tokenizer_spec or recorded or cfg.data.tokenizer, source, chat_template,
                       checkpoint, state)


def load_model(spec: Path, cfg: Config, tokenizer_spec: str | None) -> Loaded:
    """The model of a foldmoe checkpoint or an HF model directory, with its tokenizer and chat template. The weights
    are read a tensor (an HF directory's: a layer) at a time into a model built in the target dtype on the target
    device: host memory holds that, not a copy of the model (bench/bench_model_load.py)."""
    device = rollout_device(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" and cfg.run.dtype == "bf16" else torch.float32
    opened = open_model(spec, cfg, tokenizer_spec, dtype)
    with parameters_on_meta():
        model = MoETransformer(rollout_model_config(opened.cfg))
    model.to(dtype=dtype)  # the meta parameters and the buffers
    materialize(model, device)
    model.to(device)  # the buffers
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in opened.state:
            if name not in targets:
                raise GenerateError(f"{opened.source} holds {name}, which its model config's model has not")
            targets.pop(name).copy_(value)
    if targets:  # every parameter and saved buffer gets a value, as a strict load_state_dict asks
        raise GenerateError(f"{opened.source} holds no value for {', '.join(list(targets)[:5])}")
    return Loaded(model.eval(), opened.tokenizer, opened.tokenizer_spec, opened.source, opened.chat_template)


def as_chat(prompts: list[Prompt], chat: ChatTemplate) -> tuple[list[Prompt], str]:
    """Each prompt as a user turn rendered with the generation prompt, and the text that ends an assistant turn (a
    stop string; "" where the template adds none)."""
    probe = "\x00"
    user = [{"role": "user", "content": "?"}]
    before = chat.render(user, add_generation_prompt=True)
    turn = chat.render(user + [{"role": "assistant", "content": probe}], add_generation_prompt=False)[len(before):]
    end = turn.split(probe, 1)[1].strip() if probe in turn else ""
    rendered = [(chat.render([{"role": "user", "content": text}], add_generation_prompt=True), meta)
                for text, meta in prompts]
    return rendered, end


def read_prompts(args: argparse.Namespace, reward: RewardFn | None) -> list[Prompt]:
    """(text, the reward's meta) of the --prompt values, then of --prompts FILE's records (a .jsonl file, read as
    `rl.prompts` is) or lines (`-`: standard input); none given: one empty prompt."""
    prompts: list[Prompt] = [(text, {}) for text in args.prompt or []]
    if args.prompts is not None and str(args.prompts).endswith(".jsonl"):
        prompts += read_records([str(args.prompts)], reward, key="--prompts")
    elif args.prompts is not None:
        try:
            text = sys.stdin.read() if str(args.prompts) == "-" else Path(args.prompts).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise GenerateError(f"cannot read prompts from {args.prompts}: {e}") from None
        prompts += [(line, {}) for line in text.splitlines() if line.strip()]
    prompts = prompts or [("", {})]
    if reward in ANSWER_CHECKS and any("answer" not in meta for _, meta in prompts):
        raise GenerateError(f"--reward {args.reward} compares each completion with its record's \"answer\": give the "
                            "prompts as a .jsonl file of records (--prompts FILE.jsonl)")
    return prompts


def build_requests(prompts: list[Prompt], tokenizer: Tokenizer, params: SamplingParams, samples: int
                   ) -> list[Request]:
    requests = []
    for i, (text, _) in enumerate(prompts):
        tokens = tokenizer.encode(text) or [tokenizer.eos_id]
        requests += [Request(tokens, params, tag=(i, j)) for j in range(samples)]
    return requests


def _score(reward: RewardFn, spec: str, prompt: str, c: Completion, meta: dict) -> float:
    try:
        return float(reward(prompt, c.text, meta))
    except Exception as e:  # the user's function: whatever it raises is named, not a traceback
        raise GenerateError(f"--reward {spec} failed on prompt {c.tag[0] + 1}: {type(e).__name__}: {e}") from None


def _show(c: Completion, prompt: str, reward: float | None, as_json: bool) -> str:
    i, j = c.tag
    if as_json:
        scored = {} if reward is None else {"reward": reward}
        return json.dumps({"prompt_index": i, "sample": j, "prompt": prompt, "completion": c.text,
                           "tokens": len(c.tokens), "token_ids": c.tokens, "finish_reason": c.finish_reason,
                           "logprob": round(sum(c.logprobs), 4), **scored})
    scored = "" if reward is None else f", reward {reward:g}"
    return f"--- prompt {i + 1}, sample {j + 1} ({len(c.tokens)} tokens, {c.finish_reason}{scored})\n{prompt}{c.text}"


def generate(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides)
    if args.samples < 1:
        raise GenerateError(f"--samples must be at least 1, got {args.samples}")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, stop=tuple(args.stop or ()))
    except ValueError as e:
        raise GenerateError(f"sampling: {e}") from None
    reward = load_reward(args.reward) if args.reward else None
    prompts = read_prompts(args, reward)
    spec = Path(args.checkpoint or cfg.checkpoint.dir).expanduser()
    loaded = load_model(spec, cfg, args.tokenizer)
    model, tokenizer, source = loaded.model, loaded.tokenizer, loaded.source
    fed = prompts
    if args.chat:
        template = loaded.chat_template or cfg.data.chat_template
        if not template:
            raise GenerateError(f"--chat renders prompts with a chat template, but {source} was trained with none "
                                "(data.chat_template); set data.chat_template=FILE")
        fed, end = as_chat(prompts, load_chat_template(template))
        params = dataclasses.replace(params, stop=params.stop + ((end,) if end else ()))
    requests = build_requests(fed, tokenizer, params, args.samples)
    longest = max(len(r.prompt_tokens) for r in requests)
    say(f"generating {len(requests)} completion(s) of up to {params.max_tokens} tokens from {source} "
         f"({next(model.parameters()).device})")
    engine = Engine(model, tokenizer, max_batch=min(len(requests), MAX_BATCH), max_seq_len=longest + params.max_tokens,
                    seed=args.seed if args.seed is not None else random.getrandbits(63),
                    cuda_graphs=cfg.rl.cuda_graphs, prefill_tokens=cfg.rl.prefill_tokens)
    finished: dict[tuple[int, int], Completion] = {}
    order = [r.tag for r in requests]
    shown = 0
    rewards: list[float] = []
    start = time.perf_counter()
    with Progress(console=_err, transient=True, disable=not _err.is_terminal) as progress:
        task = progress.add_task("generating", total=len(requests))

        def complete(c: Completion) -> None:  # print in prompt order, each as soon as those before it are done
            nonlocal shown
            finished[c.tag] = c
            progress.advance(task)
            while shown < len(order) and order[shown] in finished:  # rich's live bar keeps below printed lines
                done = finished.pop(order[shown])
                text, meta = prompts[done.tag[0]]
                if reward is not None:
                    rewards.append(_score(reward, args.reward, text, done, meta))
                print(_show(done, text, rewards[-1] if reward is not None else None, args.json), flush=True)
                shown += 1

        try:
            completions = engine.generate(requests, complete)
        finally:
            engine.close()
    seconds = time.perf_counter() - start
    generated = sum(len(c.tokens) for c in completions)
    if rewards:
        say(f"mean reward {sum(rewards) / len(rewards):.4f} over {len(rewards)} completions ({args.reward})")
    first_use = ", the first forwards' compilation included" if next(model.parameters()).is_cuda else ""
    say(f"{generated} tokens in {seconds:.2f} s ({generated / max(seconds, 1e-9):,.0f} tokens/s{first_use})")


def _parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n")[0].split(": ", 1)[1]
    parser = argparse.ArgumentParser(prog="foldmoe generate", description=doc)
    add_model_arguments(parser)
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for more); none: one empty prompt")
    parser.add_argument("--prompts", default=None, help="a file of prompts, one per line (`-`: standard input), or "
                        "a .jsonl file of records: {\"prompt\": ..., and what --reward reads}")
    parser.add_argument("--samples", type=int, default=1, help="completions per prompt (default 1)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per completion at most (default 128)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus: the likeliest tokens reaching p (1: off)")
    parser.add_argument("--stop", action="append", help="stop once the completion holds this text (repeatable)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one)")
    parser.add_argument("--chat", action="store_true", help="each prompt a user turn, rendered by the chat template "
                        "the model was trained with (data.chat_template); stops at the end of the assistant's turn")
    parser.add_argument("--reward", default=None, help="score each completion against its record: a registered reward "
                        "(number, exact, ...) or module:function; prints the mean")
    parser.add_argument("--json", action="store_true", help="one JSON object per completion")
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `load_model` reads (--config, --checkpoint, --tokenizer) and the config overrides."""
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML config: checkpoint.dir, run.device, run.dtype (default: built-in tiny CPU run)")
    parser.add_argument("--checkpoint", default=None,
                        help="a step_NNNNNNNN directory, a checkpoint.dir or an HF model directory "
                             "(default: the config's checkpoint.dir)")
    parser.add_argument("--tokenizer", default=None,
                        help="\"byte\" or a tokenizer.json (default: the one the checkpoint was trained with)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, later wins")


def main(argv: list[str] | None = None) -> int:
    return run_command("foldmoe generate", _parser(), argv, generate,
                       (GenerateError, ConvertError, HFError, ConfigError, CheckpointError, TokenizerError,
                        EngineError, DataError, OSError))


if __name__ == "__main__":
    sys.exit(main())
