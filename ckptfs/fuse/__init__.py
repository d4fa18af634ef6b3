"""The FUSE side: the request loop and fast path (loop.py, fastpath.py) and the POSIX
handlers and control files (ops.py)."""
