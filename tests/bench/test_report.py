"""docs/benchmarks.md's performance table is generated from the results files, with machine and command."""

import json

from asyncwebrl.bench.report import BEGIN, END, main, update_table
from asyncwebrl.results import write_result


def test_performance_table_comes_from_results_files(tmp_path):
    results = tmp_path / "results"
    write_result("e2e", {"steps": 3}, {"whole_run_speedup": 1.234, "ideal_overlap_bound": 1.5}, path=results / "e2e.json")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    update_table(doc, results)
    text = doc.read_text()
    assert BEGIN in text and END in text and text.startswith("# Benchmarks\n\nintro\n")
    row = next(line for line in text.splitlines() if "async/sync trajectories/s, whole run" in line)
    assert "1.23" in row and "asyncwebrl bench e2e" in row and "cores" in row
    assert "Not measured yet" in text and "train-default" in text
    # a figure the table expects but the file lacks is named, not silently dropped
    assert "e2e: async/sync, steady state (median step) (steady_state_speedup)" in text
    # regenerating replaces the table and keeps the prose on both sides of it
    doc.write_text(doc.read_text() + "\nprose after the table\n")
    write_result("e2e", {}, {"whole_run_speedup": 2.5}, path=results / "e2e.json")
    update_table(doc, results)
    text = doc.read_text()
    assert text.count(BEGIN) == 1 and "2.5" in text and "1.23" not in text
    assert text.rstrip().endswith("prose after the table") and "intro" in text
    assert json.loads((results / "e2e.json").read_text())["name"] == "e2e"


def test_large_figures_are_written_as_whole_numbers(tmp_path):
    results = tmp_path / "results"
    write_result("warmstart", {}, {"bc_wall_s": 1311.9}, path=results / "warmstart.json")
    doc = tmp_path / "benchmarks.md"
    update_table(doc, results)
    row = next(line for line in doc.read_text().splitlines() if "warm start wall time" in line)
    assert "| 1,312 |" in row


def test_the_command_writes_the_named_doc_only(tmp_path, capsys):
    doc = tmp_path / "bench.md"
    doc.write_text(f"# B\n\n{BEGIN}\nold\n{END}\n")
    assert main([f"doc={doc}"]) == 0
    text = doc.read_text()
    assert "old" not in text and "| benchmark | figure |" in text
    assert str(doc) in capsys.readouterr().out
