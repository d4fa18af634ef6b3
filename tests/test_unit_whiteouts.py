"""Whiteouts (whiteouts.Whiteouts): another writer's entry a writer removed stays hidden in the
view until its own writer removes it, and no longer than that. No mount: the records are
applied by hand (peers.Peers.apply_group, as a mount's looks apply the indexes' tails)."""

from __future__ import annotations

from helpers import two_writers, view_shape

from ckptfs.format.records import InodeRec, UnlinkRec, XUnlinkRec
from ckptfs.namespace import ROOT_INO


def test_a_whiteout_goes_once_its_writer_removed_the_entry(tmp_path):
    """A whiteout hides another writer's entry until that writer removes it; then the view
    keeps nothing of it (the writer never uses the inode number again), while a whiteout of
    an entry that is still there, or not read yet, stays."""
    peers, l1, l2 = two_writers(tmp_path)
    wo = peers.whiteouts
    peers.apply_group(l1, [InodeRec(2, 1, b"f", 0o100644, 0, 0, 0, 1, 1, 1),
                           InodeRec(3, 1, b"g", 0o100644, 0, 0, 0, 1, 1, 1)], 10)
    peers.apply_group(l2, [XUnlinkRec("w1", 1, 2, b"f"), XUnlinkRec("w1", 1, 3, b"g"),
                           XUnlinkRec("w1", 1, 9, b"later")], 11)
    assert sorted(peers.ns.inodes[ROOT_INO].children) == []  # all hidden
    peers.apply_group(l1, [UnlinkRec(1, b"f")], 12)  # w1 carries one out
    assert wo.wo == {"w1": {(1, 3, b"g"), (1, 9, b"later")}}
    assert ("w1", 2) not in wo.wo_dirs
    # w2's index snapshot may leave out that one only (9: w1's entry not read yet)
    assert wo.settled(peers.trees[l2].xunlinks) == {("w1", 2)}
    peers.apply_group(l1, [InodeRec(9, 1, b"later", 0o100644, 0, 0, 0, 1, 1, 1)], 13)
    assert sorted(peers.ns.inodes[ROOT_INO].children) == []  # (still hidden)


def test_a_whited_out_directory_shows_again_while_its_writer_puts_something_in_it(tmp_path):
    """A whiteout of a directory hides it only while nothing inside it is visible: what its
    writer puts in it later shows, with the directory, and goes again with it."""
    peers, l1, l2 = two_writers(tmp_path)
    peers.apply_group(l1, [InodeRec(2, 1, b"d", 0o40755, 0, 0, 0, 1, 1, 1),
                           InodeRec(3, 2, b"f", 0o100644, 0, 0, 0, 1, 1, 1)], 10)
    assert view_shape(peers.view) == {b"d": {b"f": ("w1", 3)}}
    peers.apply_group(l2, [XUnlinkRec("w1", 2, 3, b"f"), XUnlinkRec("w1", 1, 2, b"d")], 11)
    assert view_shape(peers.view) == {}  # (rm -r d)
    peers.apply_group(l1, [InodeRec(4, 2, b"g", 0o100644, 0, 0, 0, 1, 1, 1)], 12)
    assert view_shape(peers.view) == {b"d": {b"g": ("w1", 4)}}  # (f stays hidden)
    peers.apply_group(l1, [UnlinkRec(2, b"g")], 13)
    assert view_shape(peers.view) == {}
