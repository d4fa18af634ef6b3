#!/bin/sh
# Install (or remove) the ckptfs mount(8)/umount(8) helpers:
#   PREFIX/sbin/mount.fuse.ckptfs   (mount -t fuse.ckptfs, /etc/fstab)
#   PREFIX/sbin/umount.fuse.ckptfs  (umount /ckpt waits until everything is durable)
# Both record the absolute path of the ckptfs executable to use (default: the one of the
# current virtual environment). mount(8) looks for helpers in /sbin, /sbin/fs.d, /sbin/fs
# (on Debian 12 /sbin is /usr/sbin), so the default prefix is /.
#
# usage: install.sh [--prefix DIR] [--sbindir DIR] [--ckptfs PATH] [--force] [--uninstall]
#   DESTDIR is prepended to every installed path (staged installs, tests).
#   Idempotent: reinstalling the same thing changes nothing; --uninstall removes only files
#   this script installed (they carry a marker) and succeeds when there is nothing to remove.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
prefix=/
sbindir=""
ckptfs=""
force=0
uninstall=0
MARKER="ckptfs-mount-helper"

die() { echo "install.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; prefix=$2; shift 2 ;;
        --prefix=*) prefix=${1#*=}; shift ;;
        --sbindir) [ $# -ge 2 ] || die "--sbindir needs a directory"; sbindir=$2; shift 2 ;;
        --sbindir=*) sbindir=${1#*=}; shift ;;
        --ckptfs) [ $# -ge 2 ] || die "--ckptfs needs a path"; ckptfs=$2; shift 2 ;;
        --ckptfs=*) ckptfs=${1#*=}; shift ;;
        --force) force=1; shift ;;
        --uninstall) uninstall=1; shift ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[ -n "$sbindir" ] || sbindir="${prefix%/}/sbin"
dest="${DESTDIR:-}$sbindir"

ours() { [ -f "$1" ] && grep -q "$MARKER" "$1"; }

if [ "$uninstall" = 1 ]; then
    for name in mount.fuse.ckptfs umount.fuse.ckptfs; do
        f="$dest/$name"
        if ours "$f"; then
            rm -f "$f"
            echo "removed $f"
        elif [ -e "$f" ]; then
            echo "install.sh: $f was not installed by ckptfs; left alone" >&2
        fi
    done
    exit 0
fi

# The ckptfs executable: --ckptfs, else the active venv, else PATH, else this checkout's venv.
if [ -z "$ckptfs" ]; then
    for cand in "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/ckptfs}" "$(command -v ckptfs 2>/dev/null || true)" \
                "$here/../.venv/bin/ckptfs" /opt/ckptfs/.venv/bin/ckptfs; do
        if [ -n "$cand" ] && [ -x "$cand" ]; then ckptfs=$cand; break; fi
    done
    [ -n "$ckptfs" ] || die "no ckptfs executable found (activate the venv or pass --ckptfs PATH)"
fi
[ -x "$ckptfs" ] || die "'$ckptfs' is not an executable"
ckptfs=$(cd "$(dirname "$ckptfs")" && pwd)/$(basename "$ckptfs")
# The path goes into a sed replacement (| delimited) and between double quotes in the helpers:
# none of the characters special there.
nl='
'
case "$ckptfs" in
    *[\"\\\$\`\|\&]*|*"$nl"*) die "unsupported characters in '$ckptfs' (\" \\ \$ \` | & newline)" ;;
esac

mkdir -p "$dest"
for pair in mount.ckptfs:mount.fuse.ckptfs umount.ckptfs:umount.fuse.ckptfs; do
    src="$here/${pair%%:*}"
    f="$dest/${pair#*:}"
    [ -f "$src" ] || die "missing $src"
    if [ -e "$f" ] && ! ours "$f" && [ "$force" = 0 ]; then
        die "$f exists and was not installed by ckptfs (use --force to replace it)"
    fi
    # a fresh name (O_EXCL): nothing someone else put in DESTDIR beforehand is written through
    tmp=$(mktemp "$f.XXXXXX") || die "cannot create a file in $dest"
    sed "s|^CKPTFS_INSTALLED=\"\"\$|CKPTFS_INSTALLED=\"$ckptfs\"|" "$src" > "$tmp"
    grep -qxF "CKPTFS_INSTALLED=\"$ckptfs\"" "$tmp" || { rm -f "$tmp"; die "could not configure $src"; }
    chmod 0755 "$tmp"
    if [ -f "$f" ] && cmp -s "$tmp" "$f"; then
        rm -f "$tmp"
        echo "up to date: $f (ckptfs: $ckptfs)"
    else
        mv -f "$tmp" "$f"
        echo "installed $f (ckptfs: $ckptfs)"
    fi
done
