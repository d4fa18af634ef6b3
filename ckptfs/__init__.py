"""ckptfs: a FUSE checkpoint file system.

The data path, one module a step:
  application write -> fs.py (FUSE handlers) -> staging.py (aligned segments, extents)
  -> flusher.py (background thread, io engine) -> io/ (io_uring or POSIX)
  -> layout.py (data logs + index in the backing directory) -> replay on mount -> reader.py
"""

__version__ = "0.1.0"
