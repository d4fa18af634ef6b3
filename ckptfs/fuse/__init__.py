"""The FUSE side: the request loop and fast path (loop.py, fastpath.py), the POSIX handlers
(ops.py) and what they call: the open handles (handles.py), other writers' entries made own
(adopt.py), listings (listings.py), the control files (control.py)."""
