"""Real directory trees walked, built and removed through directory descriptors, for the
offline tools that work on the user's trees (`ckptfs export`, `import`, `gc`): a tree may be
deeper than Python's recursion limit and its paths longer than PATH_MAX, which no call that
takes a whole path can reach. Every step is one name relative to a directory descriptor
(openat, mkdirat, unlinkat style: `dir_fd=`), and no link is followed on the way down.
"""

from __future__ import annotations

import errno
import os
import stat

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
KEEP_OPEN = 64  # descriptors of the deepest levels a cursor holds (the top's besides)

FILE, ENTER, EXIT = "file", "enter", "exit"  # the events of walk()


class DirCursor:
    """A place in a directory tree: a descriptor of the directory it is in, moved one level
    at a time (down into a name, up to the parent). Descriptors of the deepest KEEP_OPEN
    levels (and of the top) stay open, so a tree of any depth costs a bounded number of
    them; a level whose descriptor was closed is opened again through its child's `..`, and
    must be the directory that was there (device and inode), else OSError ESTALE: the tree
    was moved meanwhile."""

    def __init__(self, path: str | bytes, make: int | None = None, dir_fd: int | None = None,
                 follow: bool = True) -> None:
        """At directory `path` (of directory `dir_fd` if given; made with its missing
        parents, mode `make`, if that is given; a link to one only if `follow`)."""
        if make is not None:
            os.makedirs(path, make, exist_ok=True)
        fd = os.open(path, DIR_FLAGS if not follow else DIR_FLAGS & ~os.O_NOFOLLOW,
                     dir_fd=dir_fd)
        st = os.fstat(fd)
        self.levels: list[list] = [[fd, (st.st_dev, st.st_ino)]]  # [descriptor or None, id]
        self.open_from = 1  # levels below this one (but the top) have their descriptor closed

    @property
    def depth(self) -> int:
        return len(self.levels) - 1

    @property
    def fd(self) -> int:
        return self.levels[-1][0]

    def down(self, name: str | bytes, make: int | None = None) -> int:
        """Into directory `name` of the current one (made with mode `make` first if that is
        given and it is not there); returns its descriptor."""
        if make is not None:
            try:
                os.mkdir(name, make, dir_fd=self.fd)
            except FileExistsError:
                pass
        fd = os.open(name, DIR_FLAGS, dir_fd=self.fd)
        st = os.fstat(fd)
        self.levels.append([fd, (st.st_dev, st.st_ino)])
        while len(self.levels) - self.open_from > KEEP_OPEN:
            level = self.levels[self.open_from]
            os.close(level[0])
            level[0] = None
            self.open_from += 1
        return fd

    def parent_fd(self) -> int:
        """The descriptor of the current directory's parent, opened again if it was
        closed."""
        if self.depth == 0:
            raise ValueError("at the top of the cursor")
        parent = self.levels[-2]
        if parent[0] is None:
            fd = os.open("..", DIR_FLAGS, dir_fd=self.fd)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != parent[1]:
                os.close(fd)
                raise OSError(errno.ESTALE, "a directory on the way was moved meanwhile")
            parent[0] = fd
            self.open_from = len(self.levels) - 2
        return parent[0]

    def up(self) -> int:
        """To the parent directory; returns its descriptor."""
        fd = self.parent_fd()
        os.close(self.levels.pop()[0])
        return fd

    def close(self) -> None:
        for level in self.levels:
            if level[0] is not None:
                os.close(level[0])
        self.levels = []

    def __enter__(self) -> DirCursor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def walk(cur: DirCursor):
    """Everything below the cursor's directory, depth first, names sorted, without
    recursion, as (event, name, lstat): FILE for an entry that is not a directory (the
    cursor at its directory), ENTER for a directory (the cursor moved into it), EXIT once
    everything in it was yielded (the cursor still in it; moved up to its parent when the
    walk goes on). The cursor ends where it started."""
    listings = [iter(sorted(os.listdir(cur.fd)))]
    entered: list[tuple[str, os.stat_result]] = []
    while listings:
        for name in listings[-1]:
            st = os.stat(name, dir_fd=cur.fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                cur.down(name)
                yield ENTER, name, st
                entered.append((name, st))
                listings.append(iter(sorted(os.listdir(cur.fd))))
                break
            yield FILE, name, st
        else:
            listings.pop()
            if entered:
                name, st = entered.pop()
                yield EXIT, name, st
                cur.up()


def remove_tree(path: str | bytes, dir_fd: int | None = None) -> None:
    """Remove directory `path` (of directory `dir_fd` if given; not a link) and everything
    in it: shutil.rmtree for trees of any depth."""
    with DirCursor(path, dir_fd=dir_fd, follow=False) as cur:
        for event, entry, _ in walk(cur):
            if event == FILE:
                os.unlink(entry, dir_fd=cur.fd)
            elif event == EXIT:
                os.rmdir(entry, dir_fd=cur.parent_fd())
    os.rmdir(path, dir_fd=dir_fd)
