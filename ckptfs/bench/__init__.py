"""Benchmarks: `ckptfs bench NAME` (cli.BENCHES names them). Each module has
`main(argv) -> int`."""

import os


def drop_caches(level: int = 1) -> bool:
    """`sync; echo LEVEL > /proc/sys/vm/drop_caches` (1: page cache, 3: also dentries and
    inodes). False when not permitted (not root). This VM's memory is backed lazily: a benchmark
    that inherits a full page cache measures that, not the code (docs/benchmarks.md)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
        return True
    except OSError:
        return False
