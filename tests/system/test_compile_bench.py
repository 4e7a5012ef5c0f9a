"""``rayvit bench --compare model.compile=false,true``: kernel fusion timed side by side, compile time apart.

In tests/system (marked slow): the compiled variant compiles, seconds with inductor's cache warm and tens of
seconds without.
"""

import json

import pytest

from rayvit.cli import main


def test_bench_compares_compiled_with_eager_and_reports_compile_time_apart(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--steps", "2", "--rounds", "2", "--warmup", "1", "--json", str(out),
                 "--compare", "model.compile=false,true"]) == 0
    text = capsys.readouterr().out
    table = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("model.compile=")
             and "compiling took" not in line}
    assert table["model.compile=false"][2] == "1.000" and table["model.compile=false"][-1] == "-"
    assert float(table["model.compile=true"][2]) > 0 and float(table["model.compile=true"][-1]) > 0
    assert "model.compile=true: compiling took" in text and "outside the timing" in text
    rows = {r["variant"]: r for r in json.loads(out.read_text())["groups"][0]["rows"]}
    eager, fused = rows["model.compile=false"], rows["model.compile=true"]
    assert eager["compile_s"] is None and eager["compile_s_by_round"] == []
    assert len(fused["compile_s_by_round"]) == 2 and fused["compile_s"] == fused["compile_s_by_round"][0]
    # Compiling stayed out of the timed steps: the first round's compile dwarfs every timed step.
    assert fused["compile_s"] > 0.5 and fused["compile_s"] > 10 * fused["step_time_p90_s"]
    # The ratio is paired: the median over rounds of each round's compiled / eager images/s, in its interval.
    per_round = sorted(f / e for f, e in zip(fused["rounds"], eager["rounds"]))
    assert fused["ratio"] == pytest.approx(sum(per_round) / 2) and fused["ratio_lo"] <= fused["ratio"] <= fused["ratio_hi"]
    assert eager["ratio"] == 1.0 and fused["verdict"] in ("higher", "lower", "within noise")
