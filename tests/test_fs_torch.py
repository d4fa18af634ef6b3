"""Real torch checkpoints through a real mount: one file per tensor (torch.save / torch.load)
and torch.distributed.checkpoint (single process, no process group)."""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")

from ckptfs.bench import models  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def gpt_state_dict() -> dict:
    """A GPT-2-shaped training state (bf16 weights, fp32 Adam state, int64 step) plus hundreds
    of small tensors, float16/int64 extras, a 0-d, an empty and a 24 MiB tensor."""
    specs = models.tensor_specs("gpt2", 48 << 20) + models.small_tensor_specs(300, seed=7)
    sd = models.state_dict(specs, seed=1)
    g = torch.Generator().manual_seed(2)
    sd["extra.half.scale"] = torch.randn(1000, generator=g).to(torch.float16)
    sd["extra.half.big"] = torch.randn(3 * MiB // 2 + 3, generator=g).to(torch.float16)
    sd["extra.ids"] = torch.randint(-(1 << 62), 1 << 62, (4097,), generator=g, dtype=torch.int64)
    sd["extra.scalar"] = torch.tensor(3.25, dtype=torch.float32)
    sd["extra.empty"] = torch.empty(0, 7, dtype=torch.bfloat16)
    sd["extra.byte"] = torch.tensor([7], dtype=torch.uint8)
    sd["extra.huge"] = torch.randn(6 * MiB + 5, generator=g)  # ~24 MiB of float32
    sd["extra.strided"] = torch.randn(64, 48, generator=g).t()  # non-contiguous
    return sd


def path_of(root: str, name: str) -> str:
    return os.path.join(root, "step_100", models.file_name(name))


def save_all(root: str, sd: dict) -> None:
    for name, t in sd.items():
        p = path_of(root, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        torch.save(t, p)


def drop_cache(path: str) -> None:
    """Evict the file's clean pages from the kernel page cache, so the next read is served by
    the daemon (staging memory or data logs), not by the kernel."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_all(root: str, sd: dict, uncached: bool = True) -> None:
    for name, want in sd.items():
        p = path_of(root, name)
        if uncached:
            drop_cache(p)
        got = torch.load(p, weights_only=True)
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert torch.equal(got, want), name
        assert got.stride() == want.stride(), name
        # bit-exact (torch.equal compares values; compare the bytes too)
        assert torch.equal(raw(got), raw(want)), name


def backing_files(backing: str) -> list[str]:
    out = []
    for dp, _, fns in os.walk(backing):
        out += [os.path.relpath(os.path.join(dp, f), backing) for f in fns]
    return sorted(out)


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
    before = st["read_disk_bytes"]
    # after the barrier every segment is durable and released: reads come from the data logs
    check_all(m.mountpoint, sd)
    assert m.status()["read_disk_bytes"] > before
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


def dcp_save_load(mounts, backing: str) -> None:
    """DCP save into a mount over `backing`, load back; unmount, remount, load again."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    m = mounts.mount(backing=backing)
    g = torch.Generator().manual_seed(9)
    sd = {
        "model": {f"layer{i}.weight": torch.randn(256, 64 * (i + 1), generator=g).to(
            torch.bfloat16) for i in range(8)},
        "optim": {"state": {f"p{i}": {"exp_avg": torch.randn(3000 + i, generator=g),
                                      "step": torch.tensor(i, dtype=torch.int64)}
                            for i in range(10)}},
        "big": torch.randn(3 * MiB, generator=g),
        "half": torch.randn(777, generator=g).to(torch.float16),
        "epoch": 12,
    }
    ckpt = os.path.join(m.mountpoint, "dcp", "step_7")
    os.makedirs(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=ckpt)
    assert ".metadata" in os.listdir(ckpt)

    def blank(x):
        if isinstance(x, dict):
            return {k: blank(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        return 0

    def same(a, b, where="sd"):
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, where
            assert torch.equal(a, b), where
        else:
            assert a == b, where

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = blank(sd)
        dcp.load(out, checkpoint_id=ckpt)
    same(sd, out)
    assert m.stop() == 0
    m2 = mounts.mount(backing=m.backing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = blank(sd)
        dcp.load(out, checkpoint_id=os.path.join(m2.mountpoint, "dcp", "step_7"))
    same(sd, out)
