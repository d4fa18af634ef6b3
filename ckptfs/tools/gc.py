"""`ckptfs gc`: keep the newest N checkpoints of a directory of a mounted ckptfs."""

from __future__ import annotations

import os
import shutil
import sys


def _natural(name: str) -> list:
    import re

    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def cmd_gc(a) -> int:
    """Keep the newest N entries matching a pattern in a directory of a MOUNTED ckptfs
    (numbers in names sort numerically: step_900 < step_1000); delete the rest through the
    mount, so it is recorded like any rm -r. `ckptfs compact` then reclaims the space."""
    import fnmatch

    from ckptfs import api

    top = os.path.join(a.mountpoint, a.dir.lstrip("/"))
    try:
        api.status(a.mountpoint)
    except OSError:
        print(f"ckptfs: {a.mountpoint} is not a live ckptfs mount", file=sys.stderr)
        return 1
    if a.keep < 0:
        print("ckptfs: --keep must be >= 0", file=sys.stderr)
        return 2
    names = sorted((n for n in os.listdir(top) if fnmatch.fnmatch(n, a.pattern)), key=_natural)
    doomed = names[:-a.keep] if a.keep else names
    for n in doomed:
        p = os.path.join(top, n)
        if a.dry_run:
            print(f"would remove {p}")
            continue
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
        print(f"removed {p}")
    kept = names[len(doomed):]
    print(f"kept {len(kept)}: {', '.join(kept) if kept else '-'}")
    if doomed and not a.dry_run:
        api.sync(a.mountpoint)
        print("space is reclaimed by `ckptfs compact BACKING` once unmounted")
    return 0
