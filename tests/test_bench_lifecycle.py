"""`ckptfs bench lifecycle` with a few small steps: it runs on one mount, writes well-formed
JSON and a PNG, judges the targets and leaves no mount behind. Speed is not tested here."""

from __future__ import annotations

import json

import pytest
from helpers import cli

from ckptfs import system
from ckptfs.bench import lifecycle

pytest.importorskip("torch")
pytest.importorskip("matplotlib")


def test_a_few_small_steps(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    work = tmp_path / "work"
    work.mkdir()
    proc = cli("bench", "lifecycle", "--steps", "4", "--tensors", "40", "--interval", "1.2",
               "--remounts", "1", "--dir", work, "-o", "staging-size=32M", "-o",
               "segment-size=1M", "-o", "log-size=4M", "-o", "index-snapshot-min=4K",
               "--json", out, "--plot", png, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [s["step"] for s in res["steps"]] == [0, 1, 2, 3] and res["tensors"] == 40
    assert res["guest_halt_poll_ns"] == system.guest_halt_poll_ns()
    for s in res["steps"]:
        assert s["durable_s"] > 0 and s["disk_bytes"] > 0 and s["index_bytes"] > 16
        assert 0 < s["written_s"] <= s["durable_s"] and s["flush_s"] >= 0
        assert s["app_cpu_s"] >= 0 and s["daemon_cpu_s"] >= 0 and s["steal_s"] >= 0
        assert s["live_bytes"] > 0 and s["rss_bytes"] > 0
        assert s["index_fresh_bytes"] >= 0 and s["local_index_bytes"] is None  # (no tier)
    assert res["steps"][-1]["live_bytes"] <= 2 * res["checkpoint_bytes"] + (1 << 20)
    for series in (res, res["fresh"]):  # (the times themselves belong to the benchmark)
        assert series["remount_s"] > 0 and series["replay_s"] >= 0
        assert len(series["remounts_s"]) == 1
    assert res["fresh"]["index_bytes"] > 16
    # the disk probe: at step 0 (every 5th step by default), O_DIRECT on this disk
    assert res["steps"][0]["disk_probe_s"] > 0 and res["disk_probe_direct"] is True
    assert [s["disk_probe_s"] for s in res["steps"][1:]] == [None, None, None]
    assert res["steps"][-1]["flush_s"] > 0  # each step's checkpoint went through the flusher
    assert {v["target"] for v in res["targets"]} == {"remount"}  # (no step 10 in 4 steps)
    assert "targets held" in proc.stdout
    assert not list(work.iterdir()), "the work directory stays only with --keep-dir"
    with open("/proc/self/mountinfo") as f:
        assert str(work) not in f.read()


def test_with_the_node_tier(tmp_path):
    """With -o local-dir=...: each step records the local directory and its index, and the
    aged backing directory is also remounted with its tier, as the job's restart on the node
    mounts it, judged against the fresh copy's remount too."""
    out, work, local = tmp_path / "out.json", tmp_path / "work", tmp_path / "local"
    work.mkdir()
    local.mkdir()
    proc = cli("bench", "lifecycle", "--steps", "2", "--tensors", "20", "--interval", "0.5",
               "--remounts", "1", "--probe-every", "0", "--dir", work, "-o", "staging-size=32M",
               "-o", "segment-size=1M", "-o", "log-size=4M", "-o", f"local-dir={local}",
               "--json", out, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for s in res["steps"]:
        assert s["local_disk_bytes"] > 0 and s["local_index_bytes"] > 16
    assert res["tier"]["remount_s"] > 0 and len(res["tier"]["remounts_s"]) == 1
    assert [v["what"] for v in res["targets"]] == [
        "remount <= 1.2 x the fresh copy's", "remount with the node tier <= 1.2 x the fresh "
        "copy's"]
    assert "with the node tier" in proc.stdout
    with open("/proc/self/mountinfo") as f:
        assert str(work) not in f.read()


def test_the_drift_windows(tmp_path):
    steps = [{"step": k, "durable_s": 1.0 if k <= 30 else 1.2, "written_s": 0.5,
              "flush_s": 0.4 if k <= 30 else 0.6, "disk_probe_s": (0.3 if k <= 30 else 0.45)
              if k % 5 == 0 else None} for k in range(60)]
    d = lifecycle.drift(steps)
    assert d["durable_s"] == {"early": 1.0, "last": 1.2, "n": [21, 20]}
    assert d["flush_s"]["last"] == 0.6 and d["written_s"]["last"] == 0.5
    assert d["disk_probe_s"] == {"early": 0.3, "last": 0.45, "n": [5, 4]}
    assert "1.50" in lifecycle.format_drift(d)  # the probe's ratio
    # the probe writes whole 8 MiB requests and leaves nothing behind
    t, direct = lifecycle.disk_probe(str(tmp_path / "p"), 3 << 20)
    assert t > 0 and isinstance(direct, bool) and not list(tmp_path.iterdir())


def test_the_targets_arithmetic():
    steps = [{"step": k, "durable_s": 1.0 if k < 30 else 1.05, "disk_bytes": 100 + 2 * k,
              "live_bytes": 60, "index_bytes": 10 + k % 3, "rss_bytes": 1000 + k}
             for k in range(60)]
    got = {v["target"]: v for v in lifecycle.judge(steps, 6, 1.0, 0.9, 20)}
    assert got["disk"]["held"] is False and got["disk"]["value"] == 218  # 100 + 2 * 59
    assert got["disk"]["limit"] == 1.5 * 60 + 20
    assert got["index"]["held"] is True and got["index"]["value"] == 12
    assert got["save"]["held"] is True and got["save"]["value"] == 1.05
    assert got["remount"]["held"] is True and got["remount"]["limit"] == pytest.approx(1.08)
    assert got["rss"]["held"] is True and got["rss"]["value"] == 1059
    tier = [v for v in lifecycle.judge(steps, 6, 1.0, 0.9, 20, tier_remount_s=1.2)
            if "node tier" in v["what"]]
    assert [(v["value"], v["held"]) for v in tier] == [(1.2, False)]
