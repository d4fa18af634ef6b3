"""Many ckptfs mounts, one live tree, over the GlusterFS volume (the fixtures of
tests/conftest.py): each ckptfs mount stands for a node, and the second one goes through a
second gluster client (its own caches, as on another node). What one mount makes durable shows on
the other within --refresh; an idle mount sends the volume nothing; deletes, renames and
overwrites of the other writer's entries hold after remounts and in ls/verify/export; the
torchrun job of tests/dcp_rotation_job.py (DCP saves, rotation by rank 0, a killed rank
restarted) over both clients."""

from __future__ import annotations

import pytest
from helpers import cross_writer_changes, dcp_job, idle_and_quiet, visibility


pytest.importorskip("torch")
pytestmark = [pytest.mark.glusterfs, pytest.mark.timeout(300)]


# (second_client before mounts: the ckptfs mounts over the second client go first)
def test_visible_through_another_client_within_the_delay(gdir, second_client, mounts):  # noqa: F811
    visibility(mounts, gdir, second_client(gdir))  # (each change within the delay + slack)


def test_an_idle_mount_sends_the_volume_nothing(gdir, second_client, mounts):  # noqa: F811
    """Over seconds, an idle mount (another writer on the second client) makes no call on
    the volume (strace of all its threads), and its next lookup sees the other's changes."""
    idle_and_quiet(mounts, gdir, second_client(gdir))


def test_changes_to_other_writers_entries_through_two_clients(gdir, second_client, mounts,  # noqa: F811
                                                            tmp_path):
    cross_writer_changes(mounts, gdir, second_client(gdir), str(tmp_path))


def test_torchrun_job_over_two_clients(gdir, second_client, mounts, tmp_path):  # noqa: F811
    dcp_job(mounts, gdir, second_client(gdir), tmp_path)
