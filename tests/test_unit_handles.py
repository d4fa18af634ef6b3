"""The handle table (fuse/handles.py) without a mount: what the unmount's release of the
handles whose RELEASE or RELEASEDIR it cut off leaves behind."""

from __future__ import annotations

import os
import stat

from ckptfs.format.records import InodeRec
from ckptfs.fuse.control import Control
from ckptfs.fuse.handles import Handles
from ckptfs.fuse.listings import Listings
from ckptfs.fuse.ops import Settings
from ckptfs.namespace import ROOT_INO, Namespace


def test_the_unmount_releases_each_handle_as_its_own_release_would():
    """Handles.release_all: a file's handle gives back its open of the file; a directory's
    handle gives back its listing, and leaves the directory's `opens` alone (directory
    handles never raised it): no count goes below what is open."""
    ns = Namespace(now_ns=1)
    ns.apply(InodeRec(2, ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1, b""))
    ns.apply(InodeRec(3, ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0, 0, 1, 1, 1, b""))
    ns.apply(InodeRec(4, 3, b"g", stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1, b""))
    listings = Listings(ns, lambda x: None, lambda parent, name, ino: None)
    control = Control(ns, None, None, ns.inodes.__getitem__, None, dict)
    handles = Handles(ns, None, None, None, None, control, Settings(backing="/", info={}),
                      listings=listings)
    f, d = ns.inodes[2], ns.inodes[3]
    handles.open(f, os.O_RDONLY)
    handles.open(f, os.O_RDONLY)
    kept = handles.open_dir(d)
    handles.open_dir(d)  # (the same listing, shared)
    handles.open_dir(ns.inodes[ROOT_INO])
    assert (f.opens, d.opens, listings.entries) == (2, 0, 1 + 2)
    handles.release_dir(kept)  # (RELEASEDIR, as the handlers run it)
    assert (d.opens, listings.entries) == (0, 3)
    handles.release_all()
    assert handles.by_fh == {}
    assert (f.opens, d.opens, ns.inodes[ROOT_INO].opens) == (0, 0, 0)
    assert listings.entries == 0 and listings.held == {}
