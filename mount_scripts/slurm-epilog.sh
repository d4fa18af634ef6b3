#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/opt/ckptfs/mount_scripts/slurm-epilog.sh), runs as root on
# each node at job end: `ckptfs umount $CKPTFS_MOUNTPOINT` - sync barrier, unmount, wait until
# the daemon has made everything durable in the backing directory - and reports.
# Exit 0: everything the job wrote is durable in $CKPTFS_BACKING_ROOT/$SLURM_JOB_ID.
# Exit 1 + a log line (stderr and syslog): the mount was not there, the daemon had died, or not
# everything could be made durable. Slurm then drains the node, so someone looks at it.
# Configuration: as slurm-prolog.sh (the same checks of the configuration file and of the
# mount point's place), plus CKPTFS_UMOUNT_TIMEOUT (seconds, default 600) and
# CKPTFS_UMOUNT_LAZY=1 (lazy unmount if a leftover process still holds files open).
set -u

# ckptfs starts from / with a PATH of system directories (plus the directory of the ckptfs
# executable), whatever slurmd's working directory and PATH are.
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

# trusted, source_trusted: root-paths.sh, beside this script
# shellcheck source-path=SCRIPTDIR source=root-paths.sh
. "$HERE/root-paths.sh"

source_trusted "${CKPTFS_SLURM_CONF:-/etc/ckptfs/slurm.conf}" || fail "$trust_why"
root=${CKPTFS_BACKING_ROOT:-/var/lib/ckptfs}
mnt=${CKPTFS_MOUNTPOINT:-/ckpt}
tag=${CKPTFS_LOG_TAG:-ckptfs-slurm}

ckptfs=${CKPTFS:-$(command -v ckptfs 2>/dev/null || echo /opt/ckptfs/.venv/bin/ckptfs)}
[ -x "$ckptfs" ] || fail "ckptfs executable not found ($ckptfs); set CKPTFS"
PATH=$PATH:$(dirname -- "$ckptfs")

# A path through someone else's directory or symlink could point the unmount at another mount.
why=$(trusted "$(dirname -- "$mnt")" in) || fail "refusing mount point $mnt: $why"
[ -L "$mnt" ] && fail "refusing mount point $mnt: it is a symlink"

if ! grep -qsF " $(realpath -m "$mnt") " /proc/self/mounts; then
    fail "$mnt is not mounted: nothing to unmount (did the prolog run? did the mount go away?)"
fi

flags=(--timeout "${CKPTFS_UMOUNT_TIMEOUT:-600}")
[ "${CKPTFS_UMOUNT_LAZY:-0}" = 1 ] && flags+=(--lazy)
if out=$("$ckptfs" umount "$mnt" "${flags[@]}" 2>&1); then
    log "$out"
    exit 0
fi
fail "NOT everything was made durable in ${root}/${job:-?}: $out"
