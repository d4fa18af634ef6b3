"""`ckptfs gc`: keep the newest N checkpoints of a directory of a mounted ckptfs."""

from __future__ import annotations

import os
import stat
import sys

from ckptfs.tools.fdtree import remove_tree


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
    top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = sorted((n for n in os.listdir(top_fd) if fnmatch.fnmatch(n, a.pattern)),
                       key=_natural)
        doomed = names[:-a.keep] if a.keep else names
        for n in doomed:
            p = os.path.join(top, n)
            if a.dry_run:
                print(f"would remove {p}")
                continue
            # (a checkpoint's tree may be deeper than PATH_MAX allows a path to reach:
            # removed level by level through directory descriptors)
            if stat.S_ISDIR(os.stat(n, dir_fd=top_fd, follow_symlinks=False).st_mode):
                remove_tree(n, dir_fd=top_fd)
            else:
                os.unlink(n, dir_fd=top_fd)
            print(f"removed {p}")
    finally:
        os.close(top_fd)
    kept = names[len(doomed):]
    print(f"kept {len(kept)}: {', '.join(kept) if kept else '-'}")
    if doomed and not a.dry_run:
        api.sync(a.mountpoint)
        print("space is reclaimed by `ckptfs compact BACKING` once unmounted")
    return 0
