"""`ckptfs import`: copy a plain directory tree into a backing directory (through a mount)."""

from __future__ import annotations

import os
import sys

from ckptfs.tools.snapshot import Progress


def cmd_import(a) -> int:
    """Copy a plain directory tree into a backing directory (through a temporary mount, so it
    is packed like any checkpoint written to ckptfs)."""
    import shutil
    import tempfile

    from ckptfs import api

    if not os.path.isdir(a.src):
        print(f"ckptfs: {a.src} is not a directory", file=sys.stderr)
        return 1
    mnt = tempfile.mkdtemp(prefix="ckptfs-import-")
    try:
        opts = {"writer_id": a.writer} if a.writer else {}
        with api.Mount(a.backing, mnt, **opts) as m:
            dest = os.path.join(mnt, a.path.strip("/"))
            total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(a.src)
                        for f in fs if not os.path.islink(os.path.join(dp, f)))
            prog = Progress(total, "import", force=a.progress)

            def copy(src: str, dst: str) -> None:
                shutil.copy2(src, dst)
                prog.add(os.path.getsize(src))
            shutil.copytree(a.src, dest, symlinks=True, dirs_exist_ok=True, copy_function=copy)
            prog.finish()
            m.sync()
        print(f"imported {a.src} into {a.backing}:{a.path} ({total / 1e6:.1f} MB)")
        return 0
    finally:
        os.rmdir(mnt)
