"""The benchmark: variants on one cluster, measured from their stores."""

import csv


from digenrl.commands.bench import bench_config, format_table
from digenrl.commands.cli import main

from conftest import small_config


def test_bench_runs_variants_on_the_same_work(cluster_1x1, tmp_path):
    base = small_config(**{"iterations": 3})
    results = bench_config(base, ["disaggregated", "digenrl"], tmp_path, cluster=cluster_1x1)
    by = {r.name: r.stats for r in results}
    for s in by.values():
        assert s.iterations == 2 and s.images == 8 and s.gpus == 2
        assert 0 < s.ideal_fraction <= 1.0 + 1e-9
        assert 0 < s.gpu_work_s <= s.seconds * s.gpus + 1e-6
        assert set(s.utilisation) == {"rollout", "trainer"}
        for pool, u in s.utilisation.items():
            assert 0 <= u <= 1 and s.idle_s[pool] >= -1e-6
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [r["variant"] for r in rows] == ["disaggregated", "digenrl"]
    table = format_table(results)
    assert "disaggregated" in table and "/digenrl" in table


def test_bench_refuses_unknown_variants_before_any_work(tmp_path, capsys):
    code = main(["bench", "--out", str(tmp_path / "b"), "--variants", "digenrl,turbo"])
    assert code == 2
    assert "variants: expected names from" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
