"""Reading runs back from the data logs, outside a mount: what the offline tools and
compaction use (the mount's reader, datapath/reader.py, caches chunks instead)."""

from __future__ import annotations

import errno
import os

from crc32c import crc32c

from ckptfs.format.backingdir import data_log_name
from ckptfs.replay import Union


class LogReader:
    """Reads runs from the writers' data logs and checks their CRC32C."""

    def __init__(self, union: Union) -> None:
        self.union = union
        self.fds: dict[tuple[int, int], int] = {}

    def where(self, run) -> str:
        return f"{self.union.writer_ids[run.layer]}/{data_log_name(run.log)}"

    def read_run(self, run) -> bytes:
        key = (run.layer, run.log)
        fd = self.fds.get(key)
        if fd is None:
            path = os.path.join(self.union.writer_dirs[run.layer], data_log_name(run.log))
            fd = self.fds[key] = os.open(path, os.O_RDONLY)
        data = os.pread(fd, run.length, run.loff)
        if len(data) != run.length:
            raise OSError(errno.EIO, f"extent at {self.where(run)} offset {run.loff}: short read")
        if crc32c(data) != run.crc:
            raise OSError(errno.EIO, f"extent at {self.where(run)} offset {run.loff} length "
                          f"{run.length}: checksum mismatch")
        return data

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
