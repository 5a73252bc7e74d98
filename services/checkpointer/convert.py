"""Command line for Hugging Face interop (services/checkpointer/hf.py): export, import, upcycle.

    python -m services.checkpointer.convert export CKPT OUT --family FAMILY  (mixtral, qwen3_moe, qwen2_moe,
                                                        deepseek_v3, deepseek_v2, qwen3, qwen2, llama, mistral)
                                                        [--config FILE] [--dtype D] [--force] [section.key=value ...]
    python -m services.checkpointer.convert import HF_DIR OUT [--force]
    python -m services.checkpointer.convert upcycle DENSE_CKPT OUT [--config FILE] [--seed N] [--force]
                                                        [section.key=value ...]

HF_DIR may hold a published FP8 checkpoint (DeepSeek-V3's block-quantised weights are dequantised; its MTP layers
become the model's multi-token prediction depths, model.mtp_num_layers), or a dense model (qwen3, qwen2, llama,
mistral) to upcycle.
CKPT is a committed checkpoint (a step_NNNNNNNN directory) or a `checkpoint.dir` (its newest one that verifies); its
model config is the one the checkpoint records, unless `--config`/overrides give one (which must fit its weights).
`export` writes OUT/config.json and OUT/model.safetensors, or past 4 GiB of weights, shards of it with their index.
`import` and `upcycle` write OUT as a `checkpoint.dir` holding one checkpoint (step 0, model weights only) for
`checkpoint.init_from=OUT`, and OUT/model.yaml: the `model:` section a run starting from it needs. Export and import
read and convert a layer at a time: host memory holds a layer and the file (export) or part (import) being written.
Every output is built beside OUT and renamed into place when complete; an existing OUT is replaced only with --force.
Bad input is one line naming the cause and the fix, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml
from rich.console import Console
from rich.progress import track

from services.checkpointer.fit import config_diff, diff_hint, state_mismatch
from services.checkpointer.hf import HFError, export_hf, hf_config, items, open_hf, pieces, upcycle_pieces
from services.checkpointer.hf_families import FAMILIES
from services.checkpointer.layout import CheckpointError, fsync_dir, read_manifest
from services.checkpointer.load import load_checkpoint, resolve_checkpoint
from services.checkpointer.store import CheckpointStore
from services.common import logs
from services.common.command import EXIT_USAGE
from services.common.config import ConfigError, ModelConfig, load_config
from services.common.tokenizer import TokenizerError, load_tokenizer
from services.dataloader.chat import hf_chat_template, load_chat_template
from services.dataloader.errors import DataError
# The model definition is shared (as with the rollout engine): its state dict is the truth about parameter shapes, and
# saved_value is how the trainer reads a parameter back (bf16 values joined with their saved fp32 remainders).
from services.trainer.checkpointing import saved_value
from services.trainer.model.transformer import MoETransformer

HF_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")  # beside tokenizer.json
PART_BYTES = 1 << 30  # tensors per shard file of an imported checkpoint (the writer streams each file)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_err = Console(stderr=True)  # progress bars only
T = TypeVar("T")


class ConvertError(Exception):
    """Input the conversion cannot use; the message names the cause and the fix."""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # not rich: it would wrap paths at the console width in logs


# ---------------------------------------------------------------- foldmoe checkpoints in and out


def find_checkpoint(spec: str | Path) -> Path:
    """A step directory itself (it must verify), or the newest checkpoint under a checkpoint.dir that verifies."""
    try:
        return resolve_checkpoint(spec)
    except CheckpointError as e:
        raise ConvertError(f"{e}; name a checkpoint (step_NNNNNNNN with a manifest.json) or the checkpoint.dir that "
                           "holds some") from None


def recorded_config(ckpt: Path) -> dict[str, Any]:
    """The config of the run that wrote `ckpt` as a dict (the trainer records all of it, this tool the model); {}."""
    extras = read_manifest(ckpt).extras
    return (extras[0].get("config") or {}) if extras else {}


def recorded_model(ckpt: Path) -> dict[str, Any] | None:
    """The model config of the run that wrote `ckpt`, if it records one."""
    return recorded_config(ckpt).get("model") or None


def trained_config(ckpt: Path) -> ModelConfig:
    """The model config `ckpt` records (the trainer and `import` write it into every checkpoint)."""
    recorded = recorded_model(ckpt)
    if recorded is None:
        raise ConvertError(f"{ckpt} records no model config (extra.config.model); give the model's --config, or use a "
                           "checkpoint written by the foldmoe trainer or by import")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in recorded.items() if k in fields})


def progress(items: Iterable[T], what: str, total: int | None = None) -> Iterable[T]:
    """`items` (`total` of them, where they have no len()), with a progress bar on a terminal (nothing in logs and
    pipes)."""
    return track(items, what, total=total, console=_err, transient=True, disable=not _err.is_terminal)


def check_fits(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, what: str, hint: str = "") -> dict[str, tuple]:
    """`cfg`'s parameter shapes, after refusing weights of another model (services/checkpointer/fit.py)."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in MoETransformer(cfg).state_dict().items()}
    why = state_mismatch(shapes, expected)
    if why is not None:
        raise ConvertError(f"{what} holds another model than the model config describes: {why}"
                           f"{hint or '; pass the config (--config and overrides) that model was trained with'}")
    return expected


class SavedState(Mapping[str, torch.Tensor]):
    """A checkpoint's model weights by name, each read when asked for (as the trainer reads it back: bf16 values
    joined with their saved fp32 remainders), in `cfg`'s shapes."""

    def __init__(self, reader: Any, names: set[str], shapes: dict[str, tuple]):
        self._reader, self._names, self.shapes = reader, names, shapes

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        return saved_value(lambda n: self._reader.read(n).reshape(shape), name, self._names)


@contextmanager
def model_state(ckpt: Path, cfg: ModelConfig) -> Iterator[SavedState]:
    """The model weights of a verified checkpoint, read on demand while the context is open, after checking they are
    `cfg`'s model (a reader that converts or copies each where it goes holds one in memory, not the model)."""
    hint = diff_hint(recorded_model(ckpt), dataclasses.asdict(cfg))
    with load_checkpoint(ckpt, checksums=False) as c:
        names = set(c.names())
        saved = {n.removeprefix("model/"): c.global_shape(n) for n in names if n.startswith("model/")}
        yield SavedState(c, names, check_fits(saved, cfg, f"checkpoint {ckpt}", hint))


def iter_model_state(ckpt: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """`model_state`'s weights, whole, one tensor at a time."""
    with model_state(ckpt, cfg) as state:
        for name in progress(state, "reading"):
            yield name, state[name]


def write_checkpoint(root: Path, state: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]],
                     cfg: ModelConfig, run: str, source: str, hint: str) -> Path:
    """`state` (of `shapes`, checked first) as a committed step-0 checkpoint under `root`, through the writer's own
    store (manifest, sha256), written a part at a time as it comes; and root/model.yaml: the `model:` section of a
    run that starts from it. `hint`: the fix when `state` is not `cfg`'s model."""
    check_fits(shapes, cfg, source, hint)
    store = CheckpointStore(root, keep_last=0)
    entries: list[dict[str, Any]] = []
    part: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        entries.append(store.write_part(0, 0, len(entries), part,
                                        {n: (list(t.shape), [0] * t.ndim) for n, t in part.items()}))

    for name, t in state:
        if size and size + t.nbytes > PART_BYTES:
            flush()
            part, size = {}, 0
        part[f"model/{name}"] = t.detach().cpu().contiguous()
        size += t.nbytes
    flush()
    extra = {"step": 0, "config": {"model": dataclasses.asdict(cfg)}, "converted_from": source}
    store.write_rank_record(0, 0, entries, extra)
    path = store.commit(run, 0, 1)
    (root / "model.yaml").write_text(yaml.safe_dump({"model": dataclasses.asdict(cfg)}, sort_keys=False))
    return path


@contextmanager
def staged(out: Path, force: bool, source: Path) -> Iterator[Path]:
    """A directory to build the output in, renamed to `out` once complete; a failure leaves `out` as it was."""
    if out.exists() and not force:
        raise ConvertError(f"{out} already exists; pass --force to replace it, or choose another output")
    if out.resolve() == source.resolve() or out.resolve() in source.resolve().parents:
        raise ConvertError(f"{out} holds the input {source}; choose another output")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, trash = (out.with_name(f".{out.name}.{what}-{os.getpid()}") for what in ("tmp", "trash"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():  # --force: the old output goes aside first, so `out` is never half old, half new
            os.rename(out, trash)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if trash.is_dir():
        shutil.rmtree(trash)
    elif trash.exists():
        trash.unlink()


# ---------------------------------------------------------------- commands


def export_cmd(args: argparse.Namespace) -> None:
    ckpt = find_checkpoint(args.checkpoint)
    given = args.config is not None or args.overrides
    cfg = load_config(args.config, args.overrides).model if given else trained_config(ckpt)
    hf_config(cfg, args.family)  # refuse a family that cannot express this model before reading any weight
    with staged(args.out, args.force, ckpt) as tmp:
        say(f"exporting {ckpt} as {args.family} ({args.dtype})")
        with model_state(ckpt, cfg) as state:  # refuses another model's weights, naming the config differences
            diff = config_diff(recorded_model(ckpt), dataclasses.asdict(cfg))  # the same shapes, maybe not the function
            if diff:
                say(f"warning: the config differs from the one {ckpt} was trained with: {', '.join(diff)}")
            export_hf(state, cfg, args.family, tmp, dtype=DTYPES[args.dtype],
                      track=lambda blocks: progress(blocks, "exporting", pieces(cfg)))
        data = recorded_config(ckpt).get("data") or {}
        tokenizer = export_tokenizer(data, tmp)
        export_special_ids(data, tmp)
    files = sorted(p.name for p in args.out.glob("*.safetensors"))
    say(f"wrote {args.out}/config.json and {files[0] if len(files) == 1 else f'{len(files)} safetensors files'}"
        + (f", with the run's tokenizer ({', '.join(tokenizer)})" if tokenizer else ""))


def export_special_ids(data: dict[str, Any], out: Path) -> None:
    """The run's end-of-document id in out/config.json, and it and the padding id in out/generation_config.json, so
    that transformers' `generate` (and a serving engine) stops where the model learned documents end. Left out where
    the checkpoint names no tokenizer (an imported one), or its tokenizer cannot be read any more (export_tokenizer
    warns) or is wider than the model. (No pad_token_id in config.json: some families make it the embedding's
    padding_idx.)"""
    try:
        tok = load_tokenizer(data["tokenizer"])
    except (KeyError, TokenizerError):
        return
    config = json.loads((out / "config.json").read_text())
    if max(tok.eos_id, tok.pad_id) >= config["vocab_size"]:
        return
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": tok.eos_id}, indent=1))
    ids = {"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    (out / "generation_config.json").write_text(json.dumps(ids, indent=1))


def export_tokenizer(data: dict[str, Any], out: Path) -> list[str]:
    """The tokenizer the run trained with (`data`: its recorded data section) beside the exported weights, so that the
    directory loads whole (transformers' AutoTokenizer, serving engines, `foldmoe generate`): its tokenizer.json and
    the HF tokenizer files beside that, and the run's `data.chat_template` as chat_template.jinja (the only template
    there: one the copied tokenizer_config.json holds goes). Returns the files written; none for the byte tokenizer
    (which HF has no file for)."""
    spec = data.get("tokenizer") or "byte"
    if spec == "byte":
        return []
    source = Path(spec)
    if not source.is_file():
        say(f"warning: the run's tokenizer {source} is gone: the export holds no tokenizer")
        return []
    shutil.copyfile(source, out / "tokenizer.json")
    written = ["tokenizer.json"]
    for name in HF_TOKENIZER_FILES:
        if (source.parent / name).is_file():
            shutil.copyfile(source.parent / name, out / name)
            written.append(name)
    if data.get("chat_template"):  # the template the run trained with, whatever the tokenizer's files hold
        config = out / "tokenizer_config.json"
        if config.is_file():
            fields = json.loads(config.read_text(encoding="utf-8"))
            if isinstance(fields, dict) and fields.pop("chat_template", None) is not None:
                config.write_text(json.dumps(fields, indent=1), encoding="utf-8")
        (out / "chat_template.jinja").write_text(load_chat_template(data["chat_template"]).text, encoding="utf-8")
        written.append("chat_template.jinja")
    return sorted(set(written), key=written.index)


def import_cmd(args: argparse.Namespace) -> None:
    src = Path(args.hf_dir).expanduser()
    if not src.is_dir():
        raise ConvertError(f"{src}: no such directory; point at an HF model directory (config.json + *.safetensors)")
    with staged(args.out, args.force, src) as tmp:
        say(f"importing {src}")
        model = open_hf(src)
        state = progress(model.state(), "importing", pieces(model.cfg))
        path = write_checkpoint(tmp, items(state), model.shapes(), model.cfg,
                                "hf-import", f"HF model {src.resolve()}",
                                "; its config.json does not describe the tensors beside it")
    tokenizer = src.resolve() / "tokenizer.json"
    template = hf_chat_template(src.resolve())
    say(f"wrote {args.out / path.name}; start a run from it with checkpoint.init_from={args.out} and the model "
        f"section of {args.out / 'model.yaml'}"
        + (f", and its tokenizer: data.tokenizer={tokenizer}" if tokenizer.is_file() else "")
        + (f" (chat data: data.chat_template={template})" if template else ""))


def upcycle_cmd(args: argparse.Namespace) -> None:
    moe = load_config(args.config, args.overrides).model
    ckpt = find_checkpoint(args.dense)
    dense = trained_config(ckpt)
    if dense.first_k_dense < dense.num_layers:
        raise ConvertError(f"{ckpt} is an MoE model (model.first_k_dense={dense.first_k_dense} of num_layers="
                           f"{dense.num_layers}); upcycle starts from a dense one (model.first_k_dense=num_layers)")
    with staged(args.out, args.force, ckpt) as tmp, model_state(ckpt, dense) as state:
        say(f"upcycling {ckpt} to {moe.num_experts} experts (top-{moe.top_k})")
        meta = {k: torch.empty(shape, device="meta") for k, shape in state.shapes.items()}
        shapes = {k: tuple(t.shape) for k, t in items(upcycle_pieces(meta, dense, moe))}
        pieces = progress(upcycle_pieces(state, dense, moe, seed=args.seed), "upcycling", 1 + moe.num_layers)
        copied = ("head_dim", "qk_norm", "qkv_bias") + (("ffn_hidden_size",) if moe.first_k_dense else ())
        keep = [f"model.{k}={json.dumps(getattr(dense, k))}" for k in copied
                if getattr(dense, k) != getattr(moe, k)]  # what upcycle copies but does not check
        path = write_checkpoint(tmp, items(pieces), shapes, moe, "upcycle",
                                f"upcycled dense checkpoint {ckpt.resolve()}",
                                f"; the MoE model keeps the dense model's {', '.join(keep) or 'attention and MLPs'}")
    say(f"wrote {args.out / path.name}; start a run from it with checkpoint.init_from={args.out}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.checkpointer.convert", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export = commands.add_parser("export", help="a foldmoe checkpoint -> an HF model directory")
    export.add_argument("checkpoint", help="a step_NNNNNNNN directory or a checkpoint.dir (its newest valid one)")
    export.add_argument("--family", required=True, help=f"HF model family: {', '.join(FAMILIES)}")
    export.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="dtype of the HF weights (default: bfloat16)")
    imp = commands.add_parser("import", help="an HF model directory -> a foldmoe checkpoint.dir for init_from")
    imp.add_argument("hf_dir", help="an HF model directory: config.json and *.safetensors")
    up = commands.add_parser("upcycle",
                             help="a dense foldmoe checkpoint -> an MoE one (every expert a copy of the MLP)")
    up.add_argument("dense", help="the dense model's step_NNNNNNNN directory or checkpoint.dir")
    up.add_argument("--seed", type=int, default=0, help="seed of the new routers' weights")
    for sub in (export, imp, up):
        sub.add_argument("out", type=Path, help="output directory (refused if it exists, unless --force)")
        sub.add_argument("--force", action="store_true", help="replace an existing output directory")
    for sub in (export, up):
        sub.add_argument("--config", type=Path, default=None, help="YAML config whose model section describes "
                         + ("the checkpoint's model (default: the one it records)" if sub is export
                            else "the MoE model"))
        sub.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, later wins")
    return parser


def main(argv: list[str] | None = None) -> int:
    logs.configure("convert")  # hf.py logs what it reads differently from config.json (MTP layers it lacks)
    parser = _parser()
    # Overrides may follow options (`--force a.b=c`), which one nargs="*" positional cannot take: collect the rest.
    args, rest = parser.parse_known_args(argv)
    if rest and (not hasattr(args, "overrides") or any(r.startswith("-") for r in rest)):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.overrides += rest
    run = {"export": export_cmd, "import": import_cmd, "upcycle": upcycle_cmd}[args.command]
    try:
        run(args)
    except (ConvertError, HFError, ConfigError, CheckpointError, DataError, OSError) as e:
        # One line: the messages name the cause and the fix; a traceback would bury them.
        print(f"convert: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
