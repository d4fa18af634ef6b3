"""`ckptfs bench e2e --quick`: the end-to-end comparison runs every contender, writes
well-formed JSON/CSV/PNG, verifies every restore bit for bit and leaves no mount behind.
Speed is not tested here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckptfs.bench import models
from ckptfs.bench.e2e import DEFAULT_CONTENDERS, QUICK_SIZE

pytest.importorskip("torch")
pytest.importorskip("torchsnapshot")


def _our_mounts(root: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(root)]


def test_quick_run_is_complete_and_verified(tmp_path):
    out = tmp_path / "out.json"
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-m", "ckptfs", "bench", "e2e", "--quick",
                           "--dir", str(work), "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (tmp_path / "out.csv").read_text().count("\n") == len(res["summary"]) + 1
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    payload = sum(models.sizes(models.tensor_specs("gpt2", QUICK_SIZE)))
    assert res["payload_bytes"] == payload
    expected = [k for k in DEFAULT_CONTENDERS if k != "fio" or res["contenders"].count("fio")]
    assert res["contenders"] == expected
    assert set(res["summary"]) == set(expected)
    for key in expected:
        s = res["summary"][key]
        assert s["runs_ok"] == s["runs"] == 1, (key, s["errors"])
        m = s["median"]
        for f in ("blocked_s", "durable_s", "restore_s"):
            assert m[f] > 0, (key, f)
        assert m["blocked_s"] <= m["durable_s"] + 1e-9, key
        assert m["files_created"] >= 1, key
        if s["limit"]:
            assert s["bytes"] >= payload
        else:
            assert s["bytes"] == payload, key
            assert s["verified"] is True, key
    runs = {r["contender"]: r for r in res["runs"]}
    for key in expected:
        assert runs[key]["ok"], runs[key].get("error")
        if not res["summary"][key]["limit"]:
            assert runs[key]["verified"] is True
    # one file per tensor for the plain torch.save contenders
    assert res["summary"]["straight"]["median"]["files_created"] == res["tensors"]
    # ckptfs: the daemon reported its syncs; unmount and remount were measured
    ck = runs["ckptfs"]
    assert ck["unmount_s"] > 0 and ck["remount_s"] > 0
    # the daemon's CPU per GB is reported for every ckptfs row, and only there
    for key in expected:
        m = res["summary"][key]["median"]
        if key in ("ckptfs", "ckptfs_pc", "dcp_ckptfs"):
            assert m["daemon_save_cpu_s_per_gb"] >= 0 and m["daemon_restore_cpu_s_per_gb"] >= 0, key
        else:
            assert "daemon_save_cpu_s_per_gb" not in m, key
    assert ck["status_bytes_durable"] >= payload
    assert res["summary"]["ckptfs"]["time_vs_ckptfs"]["durable_s"] == pytest.approx(1.0)
    # nothing left behind: no mount, no directory under --dir, no /dev/shm leftovers
    assert _our_mounts(str(tmp_path)) == []
    assert os.listdir(work) == []
