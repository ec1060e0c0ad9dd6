"""bench.md and bench.csv: one row per config, times in ms, the plan over the best baseline."""

import csv

import pytest

from shardplan import bench
from tests.test_report import MiB, _priced, _run


def test_write_bench(tmp_path):
    rows = [bench.BenchRow("gpt", _run(searched=_priced(0.015, 300 * MiB)), seconds=12.0),
            bench.BenchRow("tight", _run(budget=100 * MiB), seconds=1.0),
            bench.BenchRow("big", None, "gpt-39b", "8 x 8", "tpu-v4", "no plan fits: x", 3.0)]
    md, path = bench.write_bench(rows, str(tmp_path))
    with open(md) as f:
        text = f.read()
    assert "| gpt | gpt-test | data=2 x model=4 | a100-80gb |" in text
    assert "(OOM)" in text and "no plan fits" in text and "0.833" in text
    with open(path) as f:
        table = list(csv.DictReader(f))
    assert [r["config"] for r in table] == ["gpt", "tight", "big"]
    assert "(none fits)" in text and table[1]["fits"] == "no"
    assert float(table[0]["plan_s"]) == pytest.approx(0.010)
    assert float(table[0]["two_d_s"]) == pytest.approx(0.012)
    assert table[0]["megatron_s"] == ""
    assert float(table[0]["plan_over_best"]) == pytest.approx(0.010 / 0.012, rel=1e-3)
    # the searched plan alone beside the kept one, and both geometric means
    assert float(table[0]["searched_s"]) == pytest.approx(0.015)
    assert float(table[0]["searched_over_best"]) == pytest.approx(0.015 / 0.012, rel=1e-3)
    assert table[1]["searched_s"] == ""
    assert "Geometric mean of searched plan alone / best expert plan: 1.250" in text
    assert "Geometric mean of kept plan / best expert plan" in text
    assert bench.geomean([0.5, 2.0, None]) == pytest.approx(1.0)
