"""bench/record.py: a benchmark's table is printed, and with --record appended to RESULTS.md with what produced it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.record import RESULTS, Table, add_record_argument  # noqa: E402


def test_a_table_is_printed_and_appended_with_machine_command_and_code(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FOLDMOE_COMMIT", "abc1234 (working tree)")
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "bench_x.py"), "--shapes", "a b"])
    results = tmp_path / "RESULTS.md"
    results.write_text("# earlier entries\n")
    table = Table()
    table.line("name   ms")
    table.line("one  1.50\ntwo  2.50")
    assert capsys.readouterr().out == "name   ms\none  1.50\ntwo  2.50\n"
    table.record(str(results), "A bench")
    table.record(None, "not recorded")
    text = results.read_text()
    assert text.startswith("# earlier entries\n")  # appended, never rewritten
    assert text.count("## ") == 1 and "## A bench (recorded by the bench)" in text
    assert "code abc1234 (working tree)." in text and " UTC;" in text and "torch " in text
    assert "- Command: `python bench/bench_x.py --shapes 'a b'`" in text
    assert "```\nname   ms\none  1.50\ntwo  2.50\n```\n" in text


def test_record_takes_a_path_and_leaves_positional_overrides_alone(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*")  # as bench_train_step has
    add_record_argument(parser)
    assert parser.parse_args([]).record is None
    args = parser.parse_args(["--record", str(RESULTS), "model.num_layers=4"])
    assert args.record == str(ROOT / "bench" / "RESULTS.md") and args.overrides == ["model.num_layers=4"]


def test_the_moe_layer_bench_records_the_table_it_prints(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = subprocess.run([sys.executable, "bench/bench_moe_layer.py", "--cpu-smoke", "--iters", "3",
                          "--shapes", "mixtral_8x7b", "--record", str(results)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    table = results.read_text().split("```\n")[1]
    assert "foldmoe MoELayer (kernels)" in table and table.strip() in out.stdout
    assert "- Command: `python bench/bench_moe_layer.py --cpu-smoke" in results.read_text()
