"""Text corpus -> tokenized, indexed dataset directory (see `dataset.py` for the layout).

Inputs: plain text files, directories of them (recursively), `.jsonl` with a "text" field per line, `.parquet` with a
"text" column (needs pyarrow). Files are tokenized in parallel and written in corpus order, so the output does not depend
on the worker count. Re-running with an unchanged corpus and tokenizer does nothing.

Supervised fine-tuning data: a `.jsonl` record (or `.parquet` row) with string "prompt" and "completion" fields instead
of "text" is one document, the prompt's tokens then the completion's and EOS, whose prompt tokens are no training
targets: the dataset's loss mask (dataset.py) marks them, and the dataloader gives them label -100 (the loss is the
completions' alone). Prompt and completion are tokenized apart, so the boundary is a token boundary. A record with
"messages" (a conversation) is rendered by `data.chat_template` and only its assistant turns are targets (chat.py).

    python -m services.dataloader.preprocess --config FILE [data.corpus=[a,b]] [--force]
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing import get_context, resource_tracker
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from services.dataloader.dataset import (FORMAT_VERSION, INDEX_FILE, LOSS_MASK_FILE, META_FILE, TOKENS_FILE,
                                         IndexedDataset, read_meta, token_dtype)
from services.dataloader.chat import ChatTemplate, Segment, check_messages, load_chat_template
from services.dataloader.errors import DataError
from services.common.jsonl import JSONLError, jsonl_records
from services.common.tokenizer import TokenizerError, load_tokenizer

# Plain-text files longer than this become one document per paragraph: a license or a source file is hundreds of
# short, self-contained paragraphs, and packing needs a spread of lengths rather than a few giant documents.
SPLIT_PARAGRAPHS_OVER = 4096
# Paragraphs shorter than this (headings, "END OF TERMS") are joined to the next one instead of standing alone.
MIN_PARAGRAPH_CHARS = 64
# Below this many corpus bytes, worker processes cost more than they save.
PARALLEL_MIN_BYTES = 4 << 20
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules"}


@dataclass(frozen=True)
class Source:
    path: str
    size: int
    mtime_ns: int


# ---------------------------------------------------------------- finding the corpus


def discover(corpus: list[str], option: str = "data.corpus") -> list[Source]:
    """Every input file named by `corpus` (the entries of `option`, which errors name), in a stable order, each once
    (symlinks resolved)."""
    if not corpus:
        raise DataError(f"`{option}` is empty: name at least one text file or directory")
    seen: set[str] = set()
    found: list[Source] = []
    for entry in corpus:
        for path in _expand(entry, option):
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            st = os.stat(real)
            found.append(Source(real, st.st_size, st.st_mtime_ns))
    if not found:
        raise DataError(f"`{option}={corpus}` holds no files")
    return found


def _expand(entry: str, option: str) -> list[str]:
    if glob.has_magic(entry):
        paths = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
        if not paths:
            raise DataError(f"corpus pattern {entry!r} matches no file; fix `{option}`")
        return paths
    if os.path.isfile(entry):
        return [entry]
    if os.path.isdir(entry):
        out = []
        for root, dirs, files in os.walk(entry, followlinks=False):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
            out.extend(os.path.join(root, f) for f in sorted(files) if not f.startswith("."))
        return [p for p in out if os.path.isfile(p)]
    raise DataError(f"corpus entry {entry!r} does not exist; fix `{option}` (files, directories or glob patterns)")


# ---------------------------------------------------------------- reading documents


Document = str | list[Segment]  # a text, or pieces of text each a training target or not (prompt/completion, chat)


def iter_documents(path: str, chat: ChatTemplate | None = None) -> Iterator[Document]:
    """The documents of one input file; raises `_NotText` for files that are not text. `chat` renders "messages"
    records."""
    if path.endswith(".jsonl"):
        yield from _jsonl_documents(path, chat)
    elif path.endswith(".parquet"):
        yield from _parquet_documents(path, chat)
    else:
        yield from _text_documents(path)


class _NotText(Exception):
    pass


def _text_documents(path: str) -> Iterator[str]:
    raw = Path(path).read_bytes()
    if b"\0" in raw:
        raise _NotText("binary (NUL bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _NotText("not UTF-8") from None
    if len(text) <= SPLIT_PARAGRAPHS_OVER:
        if text.strip():
            yield text
        return
    pending = ""
    for para in re.split(r"\n[ \t\r\f\v]*\n", text):
        para = para.strip("\n")
        if not para.strip():
            continue
        pending = f"{pending}\n\n{para}" if pending else para
        if len(pending) >= MIN_PARAGRAPH_CHARS:
            yield pending
            pending = ""
    if pending:
        yield pending


def _record_documents(record: Any, where: str, chat: ChatTemplate | None) -> list[Document]:
    """A record's documents: its "text"; its "prompt" then "completion"; or its "messages" rendered by `chat` (one
    document, or one per assistant turn: chat.py). Empty where it has nothing to train on."""
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return [record["text"]] if record["text"].strip() else []
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [[(record["prompt"], False), (record["completion"], True)]] if record["completion"].strip() else []
    if isinstance(record, dict) and "messages" in record:
        if chat is None:
            raise DataError(f"{where} is a conversation (\"messages\"): set `data.chat_template` to the template "
                            "that renders it (a Jinja file or a tokenizer_config.json)")
        return chat.documents(check_messages(record["messages"], where), where)
    raise DataError(f"{where} has neither a string \"text\" field, string \"prompt\" and \"completion\" fields, "
                    f"nor \"messages\" (keys: {sorted(record) if isinstance(record, dict) else type(record).__name__})")


def _jsonl_documents(path: str, chat: ChatTemplate | None) -> Iterator[Document]:
    try:
        for lineno, record in jsonl_records(path):
            yield from _record_documents(record, f"{path}:{lineno}", chat)
    except JSONLError as e:
        raise DataError(str(e)) from None


def _parquet_documents(path: str, chat: ChatTemplate | None) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: `.venv/bin/pip install pyarrow`, "
                        "or convert it to .jsonl") from None
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    columns = next((c for c in (["text"], ["prompt", "completion"], ["messages"]) if set(c) <= set(names)), None)
    if columns is None:
        raise DataError(f"{path} has neither a \"text\" column, \"prompt\" and \"completion\" columns, nor "
                        f"\"messages\" (columns: {names})")
    for batch in pf.iter_batches(columns=columns):
        for i, record in enumerate(batch.to_pylist()):
            yield from _record_documents(record, f"{path} row {i} of a batch", chat)


# ---------------------------------------------------------------- tokenizing one file (runs in a worker)


def open_tokenizer(spec: str):
    """`load_tokenizer` with its error as the data pipeline's `DataError`."""
    try:
        return load_tokenizer(spec)
    except TokenizerError as e:
        raise DataError(str(e)) from None


@lru_cache(maxsize=4)
def _worker_tokenizer(spec: str):
    return open_tokenizer(spec)


def tokenize_file(path: str, tokenizer_spec: str, chat_template: str = "") -> dict[str, Any]:
    """Tokens and document lengths of one file, EOS after each document, plus the file's checksum; and "targets", one
    uint8 per token (0 where a token only conditions: a prompt's, a conversation's but the assistant's), when the file
    holds such records. `chat_template`: the template of "messages" records (chat.py)."""
    tok = _worker_tokenizer(tokenizer_spec)
    chat = load_chat_template(chat_template) if chat_template else None
    dtype = token_dtype(tok.vocab_size)
    chunks: list[np.ndarray] = []
    lengths: list[int] = []
    masks: list[np.ndarray | None] = []  # per document: its targets, or None for a text (every token one)
    try:
        for doc in iter_documents(path, chat):
            if isinstance(doc, str):
                ids, mask = tok.encode(doc) + [tok.eos_id], None
            else:
                pieces = [tok.encode(text) for text, _ in doc]
                ids = [i for piece in pieces for i in piece] + [tok.eos_id]
                mask = np.asarray([t for piece, (_, t) in zip(pieces, doc) for _ in piece] + [True], dtype=np.uint8)
            chunks.append(np.asarray(ids, dtype=dtype))
            lengths.append(len(ids))
            masks.append(mask)
    except _NotText as e:
        return {"path": path, "skipped": str(e), "sha256": _sha256(path)}
    tokens = np.concatenate(chunks) if chunks else np.empty(0, dtype=dtype)
    out = {"path": path, "tokens": tokens, "lengths": np.asarray(lengths, dtype=np.int64), "sha256": _sha256(path)}
    if any(m is not None and not m.all() for m in masks):
        out["targets"] = np.concatenate([np.ones(n, dtype=np.uint8) if m is None else m
                                         for n, m in zip(lengths, masks)])
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- building the dataset


def _build_params(tokenizer_identity: dict[str, Any], chat: ChatTemplate | None) -> dict[str, Any]:
    """Everything besides the sources that decides the output bytes; a change in any of it means a rebuild. (A build
    without a chat template records None, as builds from before templates existed read.)"""
    return {"format_version": FORMAT_VERSION, "tokenizer": tokenizer_identity,
            "split_paragraphs_over": SPLIT_PARAGRAPHS_OVER, "min_paragraph_chars": MIN_PARAGRAPH_CHARS,
            "chat_template_sha256": chat.sha256 if chat else None}


def is_up_to_date(out_dir: Path, sources: list[Source], params: dict[str, Any]) -> bool:
    try:
        meta = read_meta(out_dir)
        IndexedDataset(out_dir)  # sizes and index agree with meta.json
    except DataError:
        return False
    if any(meta.get(k) != v for k, v in params.items()):
        return False
    recorded = meta.get("sources", [])
    if [r["path"] for r in recorded] != [s.path for s in sources]:
        return False
    for rec, src in zip(recorded, sources):
        # Size and mtime unchanged: trust the checksum taken then. Otherwise re-hash: a touched or copied file
        # with the same bytes must not trigger a rebuild.
        if (rec["size"], rec["mtime_ns"]) != (src.size, src.mtime_ns) and rec["sha256"] != _sha256(src.path):
            return False
    return True


def preprocess(corpus: list[str], tokenizer_spec: str, out_dir: str | Path, *, workers: int = 0, force: bool = False,
               progress: bool = True, chat_template: str = "", option: str = "data.corpus") -> Path:
    """Tokenize `corpus` into `out_dir` unless it already holds exactly that; returns `out_dir`. `chat_template`:
    `data.chat_template`, which renders "messages" records (chat.py); `option`: what errors name the corpus by."""
    out_dir = Path(out_dir)
    tok = open_tokenizer(tokenizer_spec)
    params = _build_params(tok.identity(), load_chat_template(chat_template) if chat_template else None)
    sources = discover(corpus, option)
    if not force and is_up_to_date(out_dir, sources, params):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    # meta.json goes first: from here until the new one is renamed in, the directory reads as "no dataset", never as
    # a stale meta.json describing half-written tokens.
    (out_dir / META_FILE).unlink(missing_ok=True)
    total_bytes = sum(s.size for s in sources)
    if workers <= 0:
        workers = min(os.cpu_count() or 1, len(sources)) if total_bytes >= PARALLEL_MIN_BYTES else 1
    t0 = time.monotonic()
    records, num_tokens, lengths, digest, mask_digest = _write_tokens(sources, tokenizer_spec, chat_template, out_dir,
                                                                      workers, progress)
    if num_tokens == 0:
        for name in (TOKENS_FILE, LOSS_MASK_FILE):
            (out_dir / (name + ".tmp")).unlink(missing_ok=True)
        skipped = [f"{r['path']} ({r['skipped']})" for r in records if "skipped" in r]
        raise DataError(f"`{option}={corpus}` holds no text ({len(sources)} files"
                        + (f"; skipped: {', '.join(skipped[:5])}" if skipped else "") + ")")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    with open(out_dir / (INDEX_FILE + ".tmp"), "wb") as f:
        np.save(f, offsets)
        f.flush()
        os.fsync(f.fileno())
    meta = {**params, "tokenizer_spec": tokenizer_spec,
            "dtype": token_dtype(tok.vocab_size).name, "num_docs": int(len(lengths)), "num_tokens": int(num_tokens),
            "tokens_sha256": digest, "sources": records, "build_seconds": round(time.monotonic() - t0, 3)}
    if mask_digest is not None:
        meta.update(loss_mask=True, loss_mask_sha256=mask_digest)
        os.replace(out_dir / (LOSS_MASK_FILE + ".tmp"), out_dir / LOSS_MASK_FILE)
    else:
        (out_dir / LOSS_MASK_FILE).unlink(missing_ok=True)  # an earlier build's
    os.replace(out_dir / (TOKENS_FILE + ".tmp"), out_dir / TOKENS_FILE)
    os.replace(out_dir / (INDEX_FILE + ".tmp"), out_dir / INDEX_FILE)
    _atomic_write_text(out_dir / META_FILE, json.dumps(meta, indent=1))
    return out_dir


@contextmanager
def _tokenizer_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """`workers` tokenizer processes for one build (None for one: tokenize in this process), all ended with it.

    "All" includes multiprocessing's resource tracker: the first spawn in a process starts it, and it would otherwise
    live as long as this process. `foldmoe train` builds the dataset in the launcher's own process, which ends every
    child it did not start as a stray of the run, so the build stops the tracker it started (one that was already
    running belongs to someone else). `_resource_tracker` and `_stop` are private: the stdlib has no public way.
    """
    if workers <= 1:
        yield None
        return
    tracker = resource_tracker._resource_tracker
    # private API (3.11-3.13 have both): without it, the launcher's sweep ends the tracker as before
    started_here = getattr(tracker, "_fd", 0) is None and hasattr(tracker, "_stop")
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"))
    try:
        yield pool
    finally:
        # Waits for the workers and drops the pool's queues, whose semaphores unregister from the tracker on the way:
        # a tracker stopped before that would report them as leaked, and the next unregister would start a new one.
        pool.shutdown(cancel_futures=True)
        if started_here:
            tracker._stop()


def _write_tokens(sources: list[Source], tokenizer_spec: str, chat_template: str, out_dir: Path, workers: int,
                  progress: bool):
    """Stream each file's tokens into tokens.bin.tmp in corpus order, and their loss mask into loss_mask.bin.tmp from
    the first file that has prompt/completion records on (the tokens before it marked as targets); returns (records,
    count, lengths, tokens sha256, loss mask sha256 or None without one)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    records: list[dict[str, Any]] = []
    all_lengths: list[np.ndarray] = []
    num_tokens = 0
    digest = hashlib.sha256()
    mask_digest, mask_file = None, None
    bar = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                   TextColumn("{task.fields[docs]} docs"), disable=not progress, transient=True)

    def write_targets(targets: np.ndarray) -> None:
        data = targets.tobytes()
        mask_file.write(data)
        mask_digest.update(data)

    with _tokenizer_pool(workers) as pool:
        paths = [s.path for s in sources]
        specs = [tokenizer_spec] * len(paths), [chat_template] * len(paths)
        results = (pool.map(tokenize_file, paths, *specs, chunksize=1) if pool
                   else (tokenize_file(p, tokenizer_spec, chat_template) for p in paths))
        with bar, open(out_dir / (TOKENS_FILE + ".tmp"), "wb") as out:
            task = bar.add_task("tokenize", total=sum(s.size for s in sources), docs=0)
            ndocs = 0
            try:
                for src, res in zip(sources, results):
                    rec = {"path": src.path, "size": src.size, "mtime_ns": src.mtime_ns, "sha256": res["sha256"]}
                    if "skipped" in res:
                        rec["skipped"] = res["skipped"]
                    else:
                        if "targets" in res and mask_file is None:
                            mask_file, mask_digest = open(out_dir / (LOSS_MASK_FILE + ".tmp"), "wb"), hashlib.sha256()
                            write_targets(np.ones(num_tokens, dtype=np.uint8))  # the plain texts before this file
                        if mask_file is not None:
                            write_targets(res.get("targets", np.ones(len(res["tokens"]), dtype=np.uint8)))
                        data = res["tokens"].tobytes()
                        out.write(data)
                        digest.update(data)
                        num_tokens += len(res["tokens"])
                        all_lengths.append(res["lengths"])
                        ndocs += len(res["lengths"])
                        rec.update(docs=int(len(res["lengths"])), tokens=int(len(res["tokens"])))
                    records.append(rec)
                    bar.update(task, advance=src.size, docs=ndocs)
                if mask_file is not None:
                    mask_file.flush()
                    os.fsync(mask_file.fileno())
            finally:
                if mask_file is not None:
                    mask_file.close()
            out.flush()
            os.fsync(out.fileno())
    lengths = np.concatenate(all_lengths) if all_lengths else np.empty(0, dtype=np.int64)
    return records, num_tokens, lengths, digest.hexdigest(), mask_digest.hexdigest() if mask_digest else None


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dataset_paths(cfg) -> list[Path]:
    """Where the dataset(s) of `cfg` live: `data.dataset_dir`, or one `part-<i>` under it per blended corpus entry."""
    d = cfg.data
    if not d.blend_weights:
        return [Path(d.dataset_dir)]
    if len(d.blend_weights) != len(d.corpus) or min(d.blend_weights) <= 0:
        raise DataError(f"`data.blend_weights={d.blend_weights}` needs one positive weight per `data.corpus` entry "
                        f"({len(d.corpus)} entries)")
    return [Path(d.dataset_dir) / f"part-{i}" for i in range(len(d.corpus))]


def eval_dataset_path(cfg) -> Path | None:
    """Where `data.eval_corpus` is tokenized (None without one)."""
    return Path(cfg.data.dataset_dir) / "eval" if cfg.data.eval_corpus else None


def _builds(cfg) -> list[tuple[list[str], Path, str]]:
    """(corpus entries, dataset directory, the option naming them) of every dataset `cfg` reads: `dataset_paths`',
    then `eval_dataset_path`."""
    d = cfg.data
    out = [(entries, path, "data.corpus")
           for entries, path in zip([[e] for e in d.corpus] if d.blend_weights else [d.corpus], dataset_paths(cfg))]
    if d.eval_corpus:
        out.append((d.eval_corpus, eval_dataset_path(cfg), "data.eval_corpus"))
    return out


def ensure_dataset(cfg, *, progress: bool = False) -> Path:
    """Build the dataset(s) of `cfg` (see `dataset_paths`, and `eval_dataset_path`) where missing or stale; returns
    `data.dataset_dir`.

    Fails with a `DataError` when the tokenizer's vocabulary does not fit `model.vocab_size`.
    """
    d = cfg.data
    paths = dataset_paths(cfg)
    for entry, path, option in _builds(cfg):
        preprocess(entry, d.tokenizer, path, progress=progress, chat_template=d.chat_template, option=option)
    vocab = read_meta(paths[0])["tokenizer"]["vocab_size"]
    if vocab > cfg.model.vocab_size:
        raise DataError(f"tokenizer `{d.tokenizer}` has {vocab} ids but `model.vocab_size={cfg.model.vocab_size}`; "
                        f"set model.vocab_size >= {vocab}")
    return Path(d.dataset_dir)


def main(argv: list[str] | None = None) -> int:
    from services.common.config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="python -m services.dataloader.preprocess", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--force", action="store_true", help="rebuild even if the dataset is up to date")
    parser.add_argument("--workers", type=int, default=0, help="tokenizer processes (0: automatic)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.rl.enabled:  # the dataloader packs the rollout workers' trajectories (rollout_source.py)
            print("an RL run (rl.enabled) reads no corpus: nothing to preprocess")
            return 0
        d = cfg.data
        builds = _builds(cfg)
        paths = [path for _, path, _ in builds]
        for entry, path, option in builds:
            preprocess(entry, d.tokenizer, path, workers=args.workers, force=args.force, progress=sys.stderr.isatty(),
                       chat_template=d.chat_template, option=option)
        ensure_dataset(cfg)  # the vocabulary check; the datasets are up to date by now
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        meta = read_meta(path)
        print(f"{path}: {meta['num_docs']} documents, {meta['num_tokens']} tokens "
              f"({meta['tokenizer']['kind']} tokenizer, vocab {meta['tokenizer']['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
