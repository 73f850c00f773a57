"""BENCHMARKS.md is what benchmarks/report.py renders from benchmarks/results (never edited
by hand), and a record from before a column existed renders as "–"."""
import json
import shutil
from pathlib import Path

from benchmarks.report import RESULTS, write_report

ROOT = Path(__file__).resolve().parent.parent


def test_benchmarks_md_is_rendered_from_the_results(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    write_report(results, tmp_path / "BENCHMARKS.md")
    assert (tmp_path / "BENCHMARKS.md").read_text() == (ROOT / "BENCHMARKS.md").read_text(), (
        "BENCHMARKS.md is stale: run `python benchmarks/report.py`")


def test_a_record_without_the_same_bytes_copy_renders_a_dash(tmp_path):
    result = json.loads((RESULTS / "h200.json").read_text())
    rec = dict(result["records"][0])
    del rec["copy_same_bytes_us"]
    result["records"] = [rec]
    (tmp_path / "h200.json").write_text(json.dumps(result))
    write_report(tmp_path, tmp_path / "BENCHMARKS.md")
    rows = [line for line in (tmp_path / "BENCHMARKS.md").read_text().splitlines()
            if line.startswith(f"| {rec['tp']} | {rec['tokens']} |")]
    assert len(rows) == 1, rows
    row = rows[0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[11:13] == ["–", "–"], row
