"""ckptfs: a FUSE checkpoint file system.

The data path, one package a step:
  application write -> fuse/ (request loop and fast path, POSIX handlers)
  -> datapath/staging.py (aligned segments, runs, extent maps)
  -> datapath/journal.py (changes in order) -> datapath/flusher.py (background thread driving the
  io engine, group commit) -> io/ (io_uring, POSIX)
  -> format/ (data logs + index in the backing directory)
  -> replay.py on mount (records -> namespace.py; peers.py, view.py: other writers' trees
  merged in)
  -> datapath/reader.py (the read path: readahead, read plans) -> datapath/readcache.py (the
  chunks of the data logs, their checks; loaders.py: the threads that read them)
Around it: daemon.py wires a mount, api.py and cli.py are the user's side, tools/ the offline
commands, bench/ the study and the comparisons.
"""

__version__ = "0.1.0"
