"""`ckptfs demo` (what `make demo` runs): the README's main job, end to end.

Mount a temporary ckptfs over a temporary backing directory, save a GPT-2-shaped training state
one tensor per file with plain `torch.save`, make it durable, unmount, mount again, restore every
tensor with `torch.load` and verify it bit-exact; then the same save straight into a plain
directory, for comparison.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from ckptfs import api, bench
from ckptfs.bench import models


def _drop_caches() -> bool:
    return bench.drop_caches(1)


def _save(sd: dict, root: str) -> float:
    import torch

    t0 = time.perf_counter()
    for name, t in sd.items():
        path = os.path.join(root, models.file_name(name))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(t, path)
    return time.perf_counter() - t0


def _load_verify(sd: dict, root: str) -> float:
    import torch

    t0 = time.perf_counter()
    bad = []
    for name, t in sd.items():
        got = torch.load(os.path.join(root, models.file_name(name)), weights_only=True)
        if got.dtype != t.dtype or got.shape != t.shape or not torch.equal(got, t):
            bad.append(name)
    if bad:
        raise SystemExit(f"demo: {len(bad)} tensors differ after restore, e.g. {bad[0]}")
    return time.perf_counter() - t0


def main(args) -> int:
    import torch  # noqa: F401  (fail early with a clear message when torch is missing)

    base = args.dir or "/var/tmp"
    work = tempfile.mkdtemp(prefix="ckptfs-demo-", dir=base)
    backing = os.path.join(work, "backing")
    mnt = os.path.join(work, "mnt")
    straight = os.path.join(work, "straight")
    for d in (backing, mnt, straight):
        os.makedirs(d)
    try:
        specs = models.tensor_specs("gpt2", args.size)
        sd = models.state_dict(specs)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        gb = nbytes / 1e9
        print(f"state: {len(sd)} tensors, {gb:.2f} GB (GPT-2 shapes + Adam state), "
              f"one torch.save per tensor; work dir {work}")

        _drop_caches()
        with api.Mount(backing, mnt) as m:
            st0 = m.status()
            blocked = _save(sd, mnt)
            t0 = time.perf_counter()
            m.sync()
            durable = blocked + time.perf_counter() - t0
            st = m.status()
        print(f"ckptfs   : save returned in {blocked:6.2f} s, durable after {durable:6.2f} s "
              f"({gb / durable:.2f} GB/s)  [{st['engine']}, {st['io_mode']} I/O]")
        files = sum(len(f) for _, _, f in os.walk(backing))
        print(f"           backing directory holds {files} files for {len(sd)} tensors; "
              f"{st['segments_flushed'] - st0['segments_flushed']} segments flushed")

        _drop_caches()
        with api.Mount(backing, mnt) as m:
            restore = _load_verify(sd, mnt)
        print(f"           remounted, restored and verified {len(sd)} tensors in {restore:.2f} s "
              f"({gb / restore:.2f} GB/s)")

        _drop_caches()
        blocked2 = _save(sd, straight)
        t0 = time.perf_counter()
        api.syncfs(straight)
        durable2 = blocked2 + time.perf_counter() - t0
        print(f"straight : save returned in {blocked2:6.2f} s, durable after {durable2:6.2f} s "
              f"({gb / durable2:.2f} GB/s)  [torch.save into {base}, then syncfs]")
        _drop_caches()
        restore2 = _load_verify(sd, straight)
        print(f"           restored and verified in {restore2:.2f} s ({gb / restore2:.2f} GB/s)")
        print(f"time until durable, ckptfs vs straight: {durable / durable2:.2f}x "
              "(one run; see `ckptfs bench e2e` for alternating, repeated measurements)")
        return 0
    finally:
        if api.is_mounted(mnt):
            api.fusermount(mnt, lazy=True)
        shutil.rmtree(work, ignore_errors=True)
