#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/opt/ckptfs/mount_scripts/slurm-prolog.sh), runs as root on
# each node at job start: mounts ckptfs at $CKPTFS_MOUNTPOINT over a per-job backing directory
# $CKPTFS_BACKING_ROOT/$SLURM_JOB_ID (created, mode 0700, owned by root: the daemon runs as
# root there, so no user may change what is in it), then hands the mount root to the job's user.
# Pair: slurm-epilog.sh. A non-zero exit makes Slurm drain the node and requeue the job.
#
# Every directory it creates or mounts on, and the configuration file it reads, must be one only
# root can change: owned by root, not writable by others, reached only through directories and
# symlinks of root (a sticky directory such as /var/tmp on the way is fine). Anything else
# (a symlink or a directory a user put in a shared place) is refused with an ERROR line.
#
# Configuration (environment, or /etc/ckptfs/slurm.conf sourced as shell, which must belong to
# root and be writable by root only; $CKPTFS_SLURM_CONF names another file):
#   CKPTFS_BACKING_ROOT   parent of the per-job backing directories (default /var/lib/ckptfs,
#                         created if missing); put it on the parallel file system for durable
#                         checkpoints, in a directory of root's
#   CKPTFS_MOUNTPOINT     where jobs see ckptfs (default /ckpt, created if missing)
#   CKPTFS_MOUNT_OPTS     extra `ckptfs mount` flags, e.g. "--staging-size 8G --segment-size 16M"
#   CKPTFS                the ckptfs executable (default: the PATH below, then
#                         /opt/ckptfs/.venv/bin/ckptfs)
#   CKPTFS_LOG_TAG        syslog tag (default ckptfs-slurm)
set -u

# ckptfs and its daemon start from / with a PATH of system directories (plus the directory of
# the ckptfs executable), whatever slurmd's working directory and PATH are.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
HERE=$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")  # (before the cd: a relative name)
cd / || exit 1

job=${SLURM_JOB_ID:-}
tag=${CKPTFS_LOG_TAG:-ckptfs-slurm}

log() {
    echo "$tag: job ${job:-?}: $*" >&2
    logger -t "$tag" -- "job ${job:-?}: $*" 2>/dev/null || true
}
fail() { log "ERROR: $*"; exit 1; }

# trusted, make_dir, source_trusted: root-paths.sh, beside this script
# shellcheck source-path=SCRIPTDIR source=root-paths.sh
. "$HERE/root-paths.sh"

source_trusted "${CKPTFS_SLURM_CONF:-/etc/ckptfs/slurm.conf}" || fail "$trust_why"
root=${CKPTFS_BACKING_ROOT:-/var/lib/ckptfs}
mnt=${CKPTFS_MOUNTPOINT:-/ckpt}
tag=${CKPTFS_LOG_TAG:-ckptfs-slurm}

[ -n "$job" ] || fail "SLURM_JOB_ID is not set (run as a Slurm prolog)"
case "$job" in *[!0-9A-Za-z_.-]*|.|..) fail "unexpected SLURM_JOB_ID '$job'" ;; esac
uid=${SLURM_JOB_UID:-}
gid=${SLURM_JOB_GID:-$uid}
case "$uid$gid" in *[!0-9]*) fail "unexpected SLURM_JOB_UID/GID '$uid:$gid'" ;; esac

ckptfs=${CKPTFS:-$(command -v ckptfs 2>/dev/null || echo /opt/ckptfs/.venv/bin/ckptfs)}
[ -x "$ckptfs" ] || fail "ckptfs executable not found ($ckptfs); set CKPTFS"
PATH=$PATH:$(dirname -- "$ckptfs")

mounted() { grep -qsF " $(realpath -m "$1") " /proc/self/mounts; }

# The mount point's place first: a path through someone else's directory or symlink could lead
# the unmount below, the mount and the chown of the mount root anywhere.
why=$(trusted "$(dirname -- "$mnt")" in) || fail "refusing mount point $mnt: $why"
[ -L "$mnt" ] && fail "refusing mount point $mnt: it is a symlink"

if mounted "$mnt"; then
    # A previous job's epilog did not unmount (or its daemon died): detach, but do not hide it.
    log "$mnt is still mounted from an earlier job; unmounting it first"
    "$ckptfs" umount "$mnt" >&2 || log "WARNING: the earlier mount at $mnt was not clean"
    mounted "$mnt" && fail "$mnt is still mounted; cannot mount this job's checkpoint store"
fi
why=$(make_dir "$mnt" 0755) || fail "refusing mount point $mnt: $why"

why=$(make_dir "$root" 0755) || fail "refusing CKPTFS_BACKING_ROOT $root: $why"
backing="$root/$job"
why=$(make_dir "$backing" 0700) \
    || fail "refusing backing directory $backing: $why (the daemon runs as root in it)"
chmod 0700 "$backing" || fail "cannot chmod $backing"

# Root mounts it for the job's user: allow_other lets the user in (permissions are checked by
# the kernel, default_permissions), and the mount root is handed to the user below.
read -r -a extra <<< "${CKPTFS_MOUNT_OPTS:-}"
if ! out=$("$ckptfs" mount "$backing" "$mnt" --allow-other "${extra[@]}" 2>&1); then
    fail "ckptfs mount $backing $mnt failed: $out"
fi
if [ -n "$uid" ] && [ "$uid" != 0 ]; then
    chown "$uid:$gid" "$mnt" || fail "cannot hand $mnt to $uid:$gid"
fi
log "$out"
exit 0
