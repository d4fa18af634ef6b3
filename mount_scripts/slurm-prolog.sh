#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/opt/ckptfs/mount_scripts/slurm-prolog.sh), runs as root on
# each node at job start: mounts ckptfs at $CKPTFS_MOUNTPOINT over a per-job backing directory
# $CKPTFS_BACKING_ROOT/$SLURM_JOB_ID (created), owned by the job's user.
# Pair: slurm-epilog.sh. A non-zero exit makes Slurm drain the node and requeue the job.
#
# Configuration (environment, or /etc/ckptfs/slurm.conf sourced as shell; $CKPTFS_SLURM_CONF
# names another file):
#   CKPTFS_BACKING_ROOT   parent of the per-job backing directories (default /var/tmp/ckptfs);
#                         put it on the parallel file system for durable checkpoints
#   CKPTFS_MOUNTPOINT     where jobs see ckptfs (default /ckpt)
#   CKPTFS_MOUNT_OPTS     extra `ckptfs mount` flags, e.g. "--staging-size 8G --segment-size 16M"
#   CKPTFS                the ckptfs executable (default: PATH, then /opt/ckptfs/.venv/bin/ckptfs)
#   CKPTFS_LOG_TAG        syslog tag (default ckptfs-slurm)
set -u

conf=${CKPTFS_SLURM_CONF:-/etc/ckptfs/slurm.conf}
if [ -r "$conf" ]; then
    # shellcheck source=/dev/null
    . "$conf"
fi
root=${CKPTFS_BACKING_ROOT:-/var/tmp/ckptfs}
mnt=${CKPTFS_MOUNTPOINT:-/ckpt}
tag=${CKPTFS_LOG_TAG:-ckptfs-slurm}
job=${SLURM_JOB_ID:-}

log() {
    echo "$tag: job ${job:-?}: $*" >&2
    logger -t "$tag" -- "job ${job:-?}: $*" 2>/dev/null || true
}
fail() { log "ERROR: $*"; exit 1; }

[ -n "$job" ] || fail "SLURM_JOB_ID is not set (run as a Slurm prolog)"
case "$job" in *[!0-9A-Za-z_.-]*) fail "unexpected SLURM_JOB_ID '$job'" ;; esac

ckptfs=${CKPTFS:-$(command -v ckptfs 2>/dev/null || echo /opt/ckptfs/.venv/bin/ckptfs)}
[ -x "$ckptfs" ] || fail "ckptfs executable not found ($ckptfs); set CKPTFS"

mounted() { grep -qs " $(realpath -m "$1") " /proc/self/mounts; }

if mounted "$mnt"; then
    # A previous job's epilog did not unmount (or its daemon died): detach, but do not hide it.
    log "$mnt is still mounted from an earlier job; unmounting it first"
    "$ckptfs" umount "$mnt" >&2 || log "WARNING: the earlier mount at $mnt was not clean"
    mounted "$mnt" && fail "$mnt is still mounted; cannot mount this job's checkpoint store"
fi

backing="$root/$job"
mkdir -p "$backing" "$mnt" || fail "cannot create $backing or $mnt"
chmod 0700 "$backing"
uid=${SLURM_JOB_UID:-}
gid=${SLURM_JOB_GID:-$uid}
if [ -n "$uid" ] && [ "$(id -u)" = 0 ]; then
    chown "$uid:$gid" "$backing" || fail "cannot chown $backing to $uid:$gid"
fi

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
