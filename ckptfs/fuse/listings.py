"""Directory listings: the sorted entries an open directory handle lists, shared and bounded
(trio thread only; one `Listings` per mount, CkptOperations.listings).

OPENDIR takes a listing of the directory as it is then, READDIR resumes by index into it
(POSIX allows entries added or removed during a listing to be missed or shown), RELEASEDIR
lets it go. Handles of a directory that has not changed since share one listing; the entries
all held listings have together are bounded (LISTING_ENTRIES_MAX): past it, a listing that
cannot be shared with one held already is refused (ENFILE) unless it is the only one. The
handlers (fuse/ops.py: opendir, readdir, releasedir) call it; the handle table
(fuse/handles.py) keeps the handles, a directory handle's `flags` holds its listing.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

import pyfuse3

from ckptfs.namespace import Inode, Namespace

# Entries of directory listings held by open directory handles together
LISTING_ENTRIES_MAX = 1 << 21


class Listing:
    """A directory's sorted entries as its open handles list them."""

    __slots__ = ("entries", "handles", "key")

    def __init__(self, entries: list, key) -> None:
        self.entries = entries  # (name, inode number), sorted by name
        self.handles = 1  # the open handles that hold it
        self.key = key  # where Listings.held has it


class Listings:
    """The listings open directory handles hold, by the directory's inode number, or by
    ("old", id) for a version the directory no longer has."""

    def __init__(self, ns: Namespace, attr: Callable[[Inode], pyfuse3.EntryAttributes],
                 saw_name: Callable[[int, bytes, int], None]) -> None:
        """`ns`: the tree; `attr(x)`: an entry's attributes as pyfuse3 wants them
        (READDIRPLUS); `saw_name(parent, name, ino)`: a name listed (DcpReads.saw_name: its
        open may ask no LOOKUP)."""
        self.ns = ns
        self.attr = attr
        self.saw_name = saw_name
        self.held: dict = {}
        self.entries = 0  # the entries all held listings have together

    def open(self, x: Inode) -> Listing:
        """The listing of directory x for a new directory handle: the one held, if x has not
        changed since it was taken; else a new one, ENFILE past LISTING_ENTRIES_MAX."""
        children = x.children
        held = self.held.get(x.ino)
        if held is not None and len(held.entries) == len(children) \
                and all(children.get(n) == i for n, i in held.entries):
            held.handles += 1
            return held
        if self.entries + len(children) > LISTING_ENTRIES_MAX and self.held:
            raise pyfuse3.FUSEError(errno.ENFILE)
        if held is not None:  # (an older version, still held by handles: kept apart)
            held.key = ("old", id(held))
            self.held[held.key] = held
        listing = self.held[x.ino] = Listing(sorted(children.items()), x.ino)
        self.entries += len(listing.entries)
        return listing

    def fill(self, listing: Listing, parent: int, start_id: int, token) -> None:
        """READDIR of directory `parent` from entry `start_id` on: as many entries as the
        kernel's buffer (`token`) takes; one gone from the tree since is skipped."""
        entries, inodes = listing.entries, self.ns.inodes
        for i in range(start_id, len(entries)):
            name, ino = entries[i]
            x = inodes.get(ino)
            if x is None:
                continue
            if not pyfuse3.readdir_reply(token, name, self.attr(x), i + 1):
                break
            x.lookups += 1
            self.saw_name(parent, name, ino)  # (READDIRPLUS: its open may ask no LOOKUP)

    def close(self, listing: Listing) -> None:
        """A directory handle holding `listing` is released: the listing goes with its last
        handle."""
        listing.handles -= 1
        if listing.handles <= 0 and self.held.get(listing.key) is listing:
            del self.held[listing.key]
            self.entries -= len(listing.entries)
