"""Preprocessing: text, directories and jsonl in; tokens + index + meta out, idempotent, with errors that name the cause."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.common.config import load_config
from services.dataloader.dataset import INDEX_FILE, META_FILE, TOKENS_FILE, IndexedDataset
from services.dataloader.errors import DataError
from services.dataloader.preprocess import SPLIT_PARAGRAPHS_OVER, ensure_dataset, preprocess
from services.common.tokenizer import ByteTokenizer

EOS = ByteTokenizer().eos_id


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha document\n")
    (root / "sub" / "b.md").write_text("beta document in a subdirectory\n")
    (root / "sub" / "binary.bin").write_bytes(b"\x00\x01\x02 not text")
    (root / "docs.jsonl").write_text(json.dumps({"text": "first json doc"}) + "\n\n"
                                     + json.dumps({"text": "second json doc", "id": 7}) + "\n")
    return root


def build(corpus, out, **kw):
    return IndexedDataset(preprocess([str(corpus)], "byte", out, progress=False, **kw))


def texts(ds):
    return [ByteTokenizer().decode(ds.doc(i)) for i in range(len(ds))]


def test_every_document_of_every_input_kind_ends_with_eos_in_corpus_order(corpus, tmp_path):
    ds = build(corpus, tmp_path / "ds")
    assert texts(ds) == ["alpha document\n", "first json doc", "second json doc", "beta document in a subdirectory\n"]
    assert all(ds.doc(i)[-1] == EOS for i in range(len(ds)))
    assert ds.tokens.dtype == np.uint16 and ds.num_tokens == sum(len(ds.doc(i)) for i in range(len(ds)))
    skipped = [s for s in ds.meta["sources"] if "skipped" in s]
    assert [os.path.basename(s["path"]) for s in skipped] == ["binary.bin"]


def test_large_plain_files_become_one_document_per_paragraph(tmp_path):
    paragraphs = [f"Paragraph {i}: " + "words " * (20 + 7 * i) for i in range(40)]
    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(paragraphs))
    assert big.stat().st_size > SPLIT_PARAGRAPHS_OVER
    ds = build(big, tmp_path / "ds")
    assert texts(ds) == paragraphs
    assert len(set(ds.doc_lengths.tolist())) > 10  # a spread of lengths for the packer


def test_a_real_corpus_builds_from_python_stdlib_sources(tmp_path):
    pattern = os.path.join(os.path.dirname(os.__file__), "json", "*.py")
    ds = IndexedDataset(preprocess([pattern], "byte", tmp_path / "ds", progress=False))
    assert len(ds) > 20 and ds.num_tokens > 40_000
    assert len(ds.meta["sources"]) == len(glob.glob(pattern))


def test_rerun_with_unchanged_inputs_rewrites_nothing(corpus, tmp_path):
    out = tmp_path / "ds"
    build(corpus, out)
    stamps = {f: (out / f).stat().st_mtime_ns for f in (TOKENS_FILE, INDEX_FILE, META_FILE)}
    os.utime(corpus / "a.txt", ns=(1, 1))  # touched, same bytes: the checksum says nothing changed
    build(corpus, out)
    assert {f: (out / f).stat().st_mtime_ns for f in stamps} == stamps


def test_changed_input_or_tokenizer_or_force_rebuilds(corpus, tmp_path):
    out = tmp_path / "ds"
    build(corpus, out)
    (corpus / "a.txt").write_text("alpha document, edited\n")
    assert texts(build(corpus, out))[0] == "alpha document, edited\n"
    before = (out / META_FILE).stat().st_mtime_ns
    build(corpus, out, force=True)
    assert (out / META_FILE).stat().st_mtime_ns != before


def test_output_does_not_depend_on_worker_count(corpus, tmp_path):
    one = build(corpus, tmp_path / "one", workers=1)
    two = build(corpus, tmp_path / "two", workers=2)
    assert np.array_equal(one.tokens, two.tokens) and np.array_equal(one.offsets, two.offsets)
    assert one.fingerprint == two.fingerprint


def test_a_parallel_build_leaves_no_process_of_its_own_behind(corpus, tmp_path):
    # `foldmoe train` builds the dataset in the launcher's process before it starts anything; a child left there
    # (a spawn pool starts multiprocessing's resource tracker) would be ended by the launcher's final sweep as a
    # "leftover process of this run". A fresh interpreter, so no tracker of an earlier test is already running.
    script = ("import os, sys\n"
              "from services.common.procs import children_of\n"
              "from services.dataloader.preprocess import preprocess\n"
              "preprocess([sys.argv[1]], 'byte', sys.argv[2], workers=2, progress=False)\n"
              "print(children_of(os.getpid()))\n")
    res = subprocess.run([sys.executable, "-c", script, str(corpus), str(tmp_path / "ds")], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    assert "leaked" not in res.stderr  # the tracker stopped after the pool's semaphores were released, not before
    assert len(IndexedDataset(tmp_path / "ds")) == 4


def test_missing_corpus_entry_is_named(tmp_path):
    with pytest.raises(DataError, match="does-not-exist.*does not exist"):
        preprocess([str(tmp_path / "does-not-exist")], "byte", tmp_path / "ds", progress=False)


def test_corpus_without_text_is_an_error(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "blank.txt").write_text("  \n\n")
    (tmp_path / "c" / "blob.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(DataError, match="holds no text.*blob.bin"):
        preprocess([str(tmp_path / "c")], "byte", tmp_path / "ds", progress=False)


def test_empty_corpus_directory_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        preprocess([str(tmp_path / "empty")], "byte", tmp_path / "ds", progress=False)


def test_jsonl_line_without_text_field_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text here"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2 has neither a string \"text\" field, string \"prompt\" and "
                                        r"\"completion\" fields, nor \"messages\""):
        preprocess([str(bad)], "byte", tmp_path / "ds", progress=False)


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match="needs pyarrow.*pip install pyarrow"):
        preprocess([str(tmp_path / "x.parquet")], "byte", tmp_path / "ds", progress=False)


def test_parquet_text_column_is_read_when_pyarrow_is_installed(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="parquet input is optional: it needs pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["one", "two", "", "three"]}), tmp_path / "x.parquet")
    assert texts(IndexedDataset(preprocess([str(tmp_path / "x.parquet")], "byte", tmp_path / "ds",
                                           progress=False))) == ["one", "two", "three"]


def test_truncated_token_file_is_detected(corpus, tmp_path):
    out = tmp_path / "ds"
    build(corpus, out)
    with open(out / TOKENS_FILE, "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(out)
    assert len(build(corpus, out)) == 4  # and a re-run repairs it


def test_corrupt_index_is_detected(corpus, tmp_path):
    out = tmp_path / "ds"
    build(corpus, out)
    np.save(out / INDEX_FILE, np.array([0, 5, 3, 9], dtype=np.int64))
    with pytest.raises(DataError, match="corrupt"):
        IndexedDataset(out)
    (out / INDEX_FILE).write_bytes((out / INDEX_FILE).read_bytes()[:20])
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(out)


def test_dataset_read_with_another_tokenizer_is_rejected(corpus, tmp_path):
    out = tmp_path / "ds"
    build(corpus, out)
    other = {**ByteTokenizer().identity(), "kind": "hf", "sha256": "0" * 64}
    with pytest.raises(DataError, match="tokenized with .* configured tokenizer"):
        IndexedDataset(out, expect_tokenizer=other)


def test_missing_dataset_says_how_to_build_it(tmp_path):
    with pytest.raises(DataError, match="no dataset at .*preprocess"):
        IndexedDataset(tmp_path / "nothing")


def test_ensure_dataset_checks_the_vocabulary_fits_the_model(corpus, tmp_path):
    cfg = load_config(None, [f"data.corpus=[{corpus}]", f"data.dataset_dir={tmp_path / 'ds'}"])
    assert ensure_dataset(cfg) == tmp_path / "ds"
    cfg.model.vocab_size = 128
    with pytest.raises(DataError, match="258 ids but `model.vocab_size=128`"):
        ensure_dataset(cfg)


def test_cli_builds_and_reports(corpus, tmp_path, capsys):
    from services.dataloader.preprocess import main
    assert main([f"data.corpus=[{corpus}]", f"data.dataset_dir={tmp_path / 'ds'}"]) == 0
    assert "4 documents" in capsys.readouterr().out
    assert main([f"data.corpus=[{tmp_path / 'missing'}]", f"data.dataset_dir={tmp_path / 'ds2'}"]) == 2
    assert "does not exist; fix `data.corpus`" in capsys.readouterr().err
    assert main([f"data.corpus=[{corpus}]", f"data.eval_corpus=[{tmp_path / 'missing'}]", "run.eval_interval=10",
                 f"data.dataset_dir={tmp_path / 'ds3'}"]) == 2
    assert "does not exist; fix `data.eval_corpus`" in capsys.readouterr().err  # the option that names it
