#!/bin/bash
# End-to-end example: mount ckptfs, run a 2-process torchrun job (gloo, CPU) that saves
# rank-sharded checkpoints with plain torch.save into the mount, unmount (= everything
# durable), mount the backing directory again, restore and verify every tensor, unmount.
#
#   mount_scripts/torchrun-example.sh                      # backing ./ckptfs-example, mount /ckpt
#   CKPTFS_BACKING=/lustre/me/run1 CKPTFS_MOUNTPOINT=/ckpt NPROC=2 mount_scripts/torchrun-example.sh
#   USE_TORCHRUN=0 ...                                     # python + torch.multiprocessing instead
#
# Environment: CKPTFS (ckptfs executable; default: PATH, then /opt/ckptfs/.venv/bin/ckptfs),
# PYTHON / TORCHRUN (default: next to ckptfs), CKPTFS_MOUNT_OPTS (extra `ckptfs mount` flags),
# STEPS (default 4), SAVE_EVERY (2), WIDTH (256), DEPTH (4).
# If CKPTFS_MOUNTPOINT is already a ckptfs mount (e.g. the Slurm prolog mounted it), it is used
# as is and the remount/restore phase runs against the same mount.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
ckptfs=${CKPTFS:-$(command -v ckptfs 2>/dev/null || echo /opt/ckptfs/.venv/bin/ckptfs)}
[ -x "$ckptfs" ] || { echo "ckptfs executable not found ($ckptfs); set CKPTFS" >&2; exit 1; }
bindir=$(dirname "$ckptfs")
python=${PYTHON:-$bindir/python}
[ -x "$python" ] || python=$(command -v python3)
torchrun=${TORCHRUN:-$bindir/torchrun}
backing=${CKPTFS_BACKING:-$PWD/ckptfs-example}
mnt=${CKPTFS_MOUNTPOINT:-/ckpt}
nproc=${NPROC:-2}
read -r -a mount_opts <<< "${CKPTFS_MOUNT_OPTS:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # what torchrun would set (and warn about)
train_args=(--ckpt-dir "$mnt" --steps "${STEPS:-4}" --save-every "${SAVE_EVERY:-2}"
            --width "${WIDTH:-256}" --depth "${DEPTH:-4}")

mounted() { grep -qs " $(realpath -m "$mnt") " /proc/self/mounts; }

launch() {  # launch [extra train_example.py args]
    if [ "${USE_TORCHRUN:-1}" = 1 ] && [ -x "$torchrun" ]; then
        "$torchrun" --standalone --nproc-per-node "$nproc" "$here/train_example.py" \
            "${train_args[@]}" "$@"
    else
        "$python" "$here/train_example.py" --nproc "$nproc" "${train_args[@]}" "$@"
    fi
}

ours=0
cleanup() {
    if [ "$ours" = 1 ] && mounted; then
        "$ckptfs" umount "$mnt" || fusermount3 -uz "$mnt" || true
    fi
}
trap cleanup EXIT

mount_it() {
    mkdir -p "$backing" "$mnt"
    "$ckptfs" mount "$backing" "$mnt" "${mount_opts[@]}"
    ours=1
}

if mounted; then
    echo "== using the existing mount at $mnt"
else
    echo "== mount $backing at $mnt"
    mount_it
fi

echo "== train and save through $mnt ($nproc processes)"
t0=$(date +%s.%N)
launch
"$ckptfs" status "$mnt" --json | "$python" -c 'import json,sys; s=json.load(sys.stdin); print(
    "ckptfs: %d bytes written, %d durable, %d staged" % (s["bytes_written"], s["bytes_durable"],
    s["bytes_staged"]))'

if [ "$ours" = 1 ]; then
    echo "== unmount: returns once everything is durable in $backing"
    "$ckptfs" umount "$mnt"
    ours=0
    echo "== the backing directory holds a few large files:"
    find "$backing" -type f -printf '   %10s  %P\n' | sort -k2
    "$ckptfs" verify "$backing"
    echo "== mount again and restore"
    mount_it
else
    "$ckptfs" sync "$mnt"
fi
launch --restore
t1=$(date +%s.%N)
echo "== done in $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s"
if [ "$ours" = 1 ]; then
    "$ckptfs" umount "$mnt"
    ours=0
fi
