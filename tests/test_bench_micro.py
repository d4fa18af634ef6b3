"""`ckptfs bench micro --quick`: runs on the real disk with the real engines and produces
well-formed results. Not a speed test."""

from __future__ import annotations

import csv
import json
import os

from ckptfs.bench import micro

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_run_results_plots_and_cleanup(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    out_json, out_csv, plots = tmp_path / "m.json", tmp_path / "m.csv", tmp_path / "plots"
    rc = micro.main(["--quick", "--dir", str(target), "--json", str(out_json),
                     "--csv", str(out_csv), "--plots", str(plots), "--no-progress"])
    assert rc == 0
    assert os.listdir(target) == [], "benchmark files left behind"

    doc = json.loads(out_json.read_text())
    assert doc["machine"]["nproc"] >= 1 and doc["meta"]["repeat"] == 1
    results = doc["results"]
    dims = {r["dimension"] for r in results}
    assert dims == set(micro.DIMENSIONS)
    measured = [r for r in results if not r["refused"]]
    assert len(measured) >= len(results) - 2
    for r in measured:
        assert r["gbps"] > 0 and r["bytes"] > 0 and r["requests"] >= 1, r
        assert r["gbps_min"] <= r["gbps"] <= r["gbps_max"], r
    for r in results:
        if r["refused"]:
            assert r["reason"] and r["gbps"] is None

    v = doc["verdicts"]
    for key in ("small_buffers_halve", "aggregation_restores", "buffered_vs_direct"):
        assert key in v and v[key]["text"], key
    assert isinstance(v["small_buffers_halve"]["holds"], bool)
    assert v["small_buffers_halve"]["ratio"] > 0
    assert isinstance(v["aggregation_restores"]["holds"], bool)

    stdout = capsys.readouterr().out
    assert "verdicts" in stdout and "small_buffers_halve" in stdout

    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(results)

    pngs = sorted(os.listdir(plots))
    assert pngs == sorted(f"micro-{d}.png" for d in micro.DIMENSIONS)
    for name in pngs:
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000


def test_merge_adjacent_and_layout():
    reqs = micro._layout([100, 200, 300, 5000])
    assert reqs == [(0, 100, 0), (100, 200, 100), (300, 300, 300), (600, 5000, 600)]
    assert micro.merge_adjacent(reqs, 600) == [(0, 600, 0), (600, 5000, 600)]
    mis = micro._uniform(3 * 65536, 65536, misalign=3)
    assert all(a % 4096 and n % 4096 for a, n, _ in mis)
