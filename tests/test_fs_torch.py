"""Real torch checkpoints through a real mount: one file per tensor (torch.save / torch.load)
and torch.distributed.checkpoint (single process, no process group)."""

from __future__ import annotations

import os

import pytest
from helpers import backing_files, check_all, dcp_save_load, gpt_state_dict, save_all

torch = pytest.importorskip("torch")


pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def test_torch_save_one_file_per_tensor(mounts):
    sd = gpt_state_dict()
    dtypes = {t.dtype for t in sd.values()}
    assert {torch.bfloat16, torch.float16, torch.float32, torch.int64} <= dtypes
    assert len(sd) >= 300
    assert max(t.numel() * t.element_size() for t in sd.values()) > 20 * MiB
    # staging larger than the checkpoint: writers never wait for a free segment (backpressure
    # is tested in test_fs_concurrency.py)
    m = mounts.mount(staging_size="512M")
    save_all(m.mountpoint, sd)
    # read back right away: from staging memory (or whatever the flusher already wrote)
    check_all(m.mountpoint, sd)
    m.sync()
    st = m.status()
    assert st["bytes_durable"] >= sum(t.numel() * t.element_size() for t in sd.values())
    assert st["uncommitted_changes"] == 0
    before = st["read_disk_bytes"], st["read_memory_bytes"]
    # after the barrier every segment is durable, its buffer back in the pool and not reused
    # (staging is larger than the checkpoint): reads come from memory; the second mount's
    # below come from the data logs
    check_all(m.mountpoint, sd)
    st = m.status()
    assert st["read_memory_bytes"] > before[1] and st["read_disk_bytes"] == before[0]
    assert m.stop() == 0
    assert "NOT everything" not in mounts.log(m)

    files = backing_files(m.backing)
    logs = [f for f in files if os.path.basename(f).startswith("data-")]
    assert 1 <= len(logs) <= 4, files
    assert len(files) <= 12, files  # a handful of files, not one per tensor

    m2 = mounts.mount(backing=m.backing)
    check_all(m2.mountpoint, sd)
    # the tree is there, with every name
    n = sum(len(fns) for _, _, fns in os.walk(os.path.join(m2.mountpoint, "step_100")))
    assert n == len(sd)
    log = mounts.log(m2)
    assert "warning" not in log.lower() or " 0 warnings" in log
    assert m2.stop() == 0


def test_torch_overwrite_same_names(mounts):
    """A second checkpoint over the first one's names (torch.save truncates): the newest wins,
    before and after remount."""
    m = mounts.mount()
    g = torch.Generator().manual_seed(5)
    first = {f"t{i}": torch.randn(1000 * (i + 1), generator=g) for i in range(20)}
    second = {f"t{i}": torch.randn(500 * (i + 1), generator=g).to(torch.bfloat16)
              for i in range(20)}
    save_all(m.mountpoint, first)
    m.sync()
    save_all(m.mountpoint, second)
    check_all(m.mountpoint, second)
    assert m.stop() == 0
    m = mounts.mount(backing=m.backing)
    check_all(m.mountpoint, second)


def test_dcp_save_load(mounts):
    dcp_save_load(mounts, mounts.backing())
