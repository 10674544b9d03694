"""README's Performance section is generated from the results files, with machine and command."""

import json

from asyncwebrl.bench.common import write_result
from asyncwebrl.bench.report import BEGIN, END, update_readme


def test_performance_section_comes_from_results_files(tmp_path):
    results = tmp_path / "results"
    write_result("e2e", {"steps": 3}, {"whole_run_speedup": 1.234, "ideal_overlap_bound": 1.5}, path=results / "e2e.json")
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\nintro\n")
    update_readme(readme, results)
    text = readme.read_text()
    assert BEGIN in text and END in text
    row = next(line for line in text.splitlines() if "async/sync trajectories/s, whole run" in line)
    assert "1.23" in row and "asyncwebrl bench e2e" in row and "cores" in row
    assert "Not measured yet" in text and "train-default" in text
    # a figure the table expects but the file lacks is named, not silently dropped
    assert "e2e: async/sync, steady state (median step) (steady_state_speedup)" in text
    # regenerating replaces the section instead of appending a second one
    write_result("e2e", {}, {"whole_run_speedup": 2.5}, path=results / "e2e.json")
    update_readme(readme, results)
    text = readme.read_text()
    assert text.count(BEGIN) == 1 and "2.5" in text and "1.23" not in text
    assert json.loads((results / "e2e.json").read_text())["name"] == "e2e"
