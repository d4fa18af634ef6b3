#!/usr/bin/env bash
# A GlusterFS volume on this machine, loopback only: the parallel file system to try ckptfs
# over (docs/glusterfs.md).
#
# usage: glusterfs.sh up | down | status | install        (as root)
#   up      installs glusterfs-server/-client when missing (apt-get), binds glusterd to the
#           brick host's loopback address, starts glusterd (PID recorded), creates and starts a
#           distributed volume of GLUSTER_BRICKS bricks under GLUSTER_DIR and mounts it at
#           GLUSTER_MOUNT; then checks that every socket of gluster is on 127.0.0.0/8.
#   down    unmounts, stops and deletes the volume, stops the brick processes and (once no
#           volume of this script is left) glusterd by PID, restores glusterd.vol, removes
#           GLUSTER_DIR.
#   install only installs the packages when missing (what `make test` does first).
#   status  prints what is up; exit 0 when the volume is started and mounted, 3 when nothing
#           is up, 1 when only part of it is.
#   Every step is idempotent: `up` on a running volume and `down` on nothing succeed; both
#   detach a dead mount (its client gone: ENOTCONN) first; `up` makes anew a volume of this
#   script whose bricks are gone (a `down` stopped halfway, a reboot).
#
# environment (defaults):
#   GLUSTER_DIR=/var/tmp/ckptfs-gluster   bricks, state; a directory of the local disk
#                                         (created 0755, state in it 0700)
#   GLUSTER_VOLUME=ckptfs                 volume name
#   GLUSTER_MOUNT=$GLUSTER_DIR/mnt        mount point of the volume
#   GLUSTER_BRICKS=2                      number of bricks (distributed, no replication)
#   GLUSTER_BRICK_SIZE=                   empty: bricks are plain directories; e.g. 64M: each
#                                         brick is a loop-mounted ext4 image of that size
#                                         (a tmpfs of that size where loop devices fail)
#   GLUSTER_HOST=                         brick/volfile host; must resolve into 127.0.0.0/8.
#                                         Default: this host's name when it resolves there,
#                                         else 127.0.0.2 (gluster refuses "localhost" and
#                                         "127.0.0.1" as brick hosts)
#   GLUSTER_TIMEOUT=60                    seconds for each gluster command, mount, wait
#   GLUSTER_RUN=/run/ckptfs-gluster       glusterd's PID file and state shared by volumes
#
# GLUSTER_DIR, its state directory and GLUSTER_RUN must be directories only root can change
# (owned by root, writable by no one else, reached only through directories and symlinks of
# root; a sticky directory such as /var/tmp on the way is fine), or be missing from such a
# place: up and down refuse anything else, such as a directory a user made in /var/tmp first,
# and touch nothing under it. GLUSTER_MOUNT must not be a symlink nor be reached through one
# of someone else's. The brick host, also the one recorded in the state directory, must be a
# plain host name or IPv4 address resolving into 127.0.0.0/8 at every up.
#
# exit codes: 0 ok, 1 failure, 2 usage, 3 the packages cannot be installed, 4 the host does
# not resolve to a loopback address (or a glusterd not started here listens elsewhere).
set -euo pipefail

# Root runs every command here from / with a PATH of system directories only.
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
SELF=$(readlink -f -- "$0")
cd /

GLUSTER_DIR=${GLUSTER_DIR:-/var/tmp/ckptfs-gluster}
GLUSTER_VOLUME=${GLUSTER_VOLUME:-ckptfs}
GLUSTER_MOUNT=${GLUSTER_MOUNT:-$GLUSTER_DIR/mnt}
GLUSTER_BRICKS=${GLUSTER_BRICKS:-2}
GLUSTER_BRICK_SIZE=${GLUSTER_BRICK_SIZE:-}
GLUSTER_HOST=${GLUSTER_HOST:-}
GLUSTER_TIMEOUT=${GLUSTER_TIMEOUT:-60}
GLUSTER_RUN=${GLUSTER_RUN:-/run/ckptfs-gluster}

GLUSTERD_VOL=/etc/glusterfs/glusterd.vol
STATE=$GLUSTER_DIR/state
PKGS=(glusterfs-server glusterfs-client)
T=$GLUSTER_TIMEOUT

say() { echo "glusterfs.sh: $*"; }
die() { local rc=$1; shift; echo "glusterfs.sh: $*" >&2; exit "$rc"; }

# The settings go into paths root removes and into gluster's commands: plain values only.
for v in GLUSTER_DIR GLUSTER_RUN GLUSTER_MOUNT; do
    case "${!v}" in /|/*/..|/*/../*|/*/.|/*/./*) die 2 "$v=${!v}: not a plain absolute path" ;;
        /*) ;; *) die 2 "$v=${!v}: not an absolute path" ;; esac
done
[[ $GLUSTER_VOLUME =~ ^[A-Za-z0-9_-]+$ ]] || die 2 "GLUSTER_VOLUME=$GLUSTER_VOLUME: letters, digits, _ and - only"
[[ $GLUSTER_BRICKS =~ ^[1-9][0-9]?$ ]] || die 2 "GLUSTER_BRICKS=$GLUSTER_BRICKS: a number from 1 to 99"
[[ $GLUSTER_BRICK_SIZE =~ ^([1-9][0-9]*[KMGkmg]?)?$ ]] || die 2 "GLUSTER_BRICK_SIZE=$GLUSTER_BRICK_SIZE: e.g. 64M"
[[ $GLUSTER_TIMEOUT =~ ^[1-9][0-9]*$ ]] || die 2 "GLUSTER_TIMEOUT=$GLUSTER_TIMEOUT: seconds"

# trusted, make_dir: root-paths.sh, beside this script (SELF: the cwd is / by now)
# shellcheck source-path=SCRIPTDIR source=root-paths.sh
. "${SELF%/*}/root-paths.sh"

# check_dir DIR: DIR is a directory only root can change, or missing from a place where only
# root can create it. Prints the reason and fails when not.
check_dir() {
    local p=$1
    if [ -e "$p" ] || [ -L "$p" ]; then trusted "$p"; return; fi
    while [ ! -e "$p" ] && [ ! -L "$p" ]; do p=$(dirname -- "$p"); done
    trusted "$p" in
}

# Before up or down reads or removes anything in them.
check_dirs() {
    local why v
    for v in GLUSTER_DIR STATE GLUSTER_RUN; do
        why=$(check_dir "${!v}") || die 1 "refusing $v ${!v}: $why (root reads and removes" \
            "files there: it must be a directory only root can change; remove it)"
    done
    # the mount point itself may be a dead mount (stat fails): its place and name are checked
    why=$(check_dir "$(dirname -- "$GLUSTER_MOUNT")") || die 1 "refusing GLUSTER_MOUNT $GLUSTER_MOUNT: $why"
    [ ! -L "$GLUSTER_MOUNT" ] || die 1 "refusing GLUSTER_MOUNT $GLUSTER_MOUNT: it is a symlink"
}

make_dirs() {
    local why
    why=$(make_dir "$GLUSTER_DIR" 0755) || die 1 "cannot make GLUSTER_DIR $GLUSTER_DIR: $why"
    why=$(make_dir "$STATE" 0700) || die 1 "cannot make $STATE: $why"
    why=$(make_dir "$GLUSTER_RUN" 0755) || die 1 "cannot make GLUSTER_RUN $GLUSTER_RUN: $why"
}

# gluster CLI, non-interactive, bounded twice (its own RPC timeout and a hard one)
g() { timeout -k 5 "$T" gluster --mode=script --timeout="$T" "$@"; }

# A process is alive when it exists and is not a zombie (PID 1 here may not reap).
alive() {
    local pid=$1 st
    [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
    st=$(sed 's/^.*) \(.\).*/\1/' "/proc/$pid/stat" 2>/dev/null) || return 1
    [ "$st" != Z ] && [ "$st" != X ]
}

cmdline_of() { { tr '\0' ' ' < "/proc/$1/cmdline"; } 2>/dev/null || true; }

# Stop one PID: SIGTERM, wait, SIGKILL.
stop_pid() {
    local pid=$1 what=$2 i
    [[ $pid =~ ^[1-9][0-9]*$ ]] || return 0
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do alive "$pid" || { say "stopped $what (pid $pid)"; return 0; }; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do alive "$pid" || { say "killed $what (pid $pid)"; return 0; }; sleep 0.1; done
    echo "glusterfs.sh: $what (pid $pid) does not exit" >&2
    return 1
}

need_root() { [ "$(id -u)" = 0 ] || die 1 "run as root (it starts glusterd, mounts, installs packages)"; }

# ---------------------------------------------------------------- packages
install_packages() {
    local missing=() p
    for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    command -v ss >/dev/null 2>&1 || missing+=(iproute2)
    [ ${#missing[@]} -eq 0 ] && return 0
    command -v apt-get >/dev/null 2>&1 || die 3 "cannot install ${missing[*]}: no apt-get"
    say "installing ${missing[*]}"
    # glusterd must not be started by the package's scripts: this script starts it itself
    # with the loopback configuration
    if ! timeout -k 10 600 apt-get update -q >/dev/null \
        || ! DEBIAN_FRONTEND=noninteractive timeout -k 10 900 \
            apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; then
        die 3 "cannot install ${missing[*]} with apt-get"
    fi
}

# ---------------------------------------------------------------- the loopback host
# The first IPv4 address of a name (nothing, not an exit under pipefail, when it does not
# resolve: the callers say so). From ahosts: ahostsv4 asks for IPv4 alone with AI_ADDRCONFIG,
# and finds nothing where the loopback holds the only IPv4 address (no network, or a network
# namespace of its own).
resolve4() { { getent ahosts "$1" 2>/dev/null || true; } | awk '$1 ~ /^[0-9.]+$/ {print $1; exit}'; }
OCTET='(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])'
# A dotted quad in 127.0.0.0/8; nothing else passes, so ADDR is safe in sed and glusterd.vol.
is_loopback4() { [[ "$1" =~ ^127\.$OCTET\.$OCTET\.$OCTET$ ]]; }
# A host name or IPv4 address and nothing else (it goes into gluster's commands).
valid_host() { [[ "$1" =~ ^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$ ]]; }

# Sets HOST (what gluster is told) and ADDR (its IPv4 address, in 127.0.0.0/8). A host recorded
# by an earlier up is checked like a new one, and its address looked up again.
pick_host() {
    local h a all
    if [ -f "$STATE/host" ]; then
        read -r h _ < "$STATE/host" || true
        valid_host "$h" || die 4 "$STATE/host does not hold a host name or IPv4 address:" \
            "refusing it (remove it if its volume is gone)"
    elif [ -n "$GLUSTER_HOST" ]; then
        h=$GLUSTER_HOST
        case "$h" in
            localhost|localhost.*|127.0.0.1|::1)
                die 4 "GLUSTER_HOST=$h: gluster refuses localhost and 127.0.0.1 as brick hosts;" \
                      "use a name that resolves to 127.0.0.1 or another loopback address (127.0.0.2)" ;;
        esac
        valid_host "$h" || die 4 "GLUSTER_HOST=$h: not a host name or IPv4 address"
    else
        h=$(hostname)
        a=$(resolve4 "$h")
        if ! valid_host "$h" || [ -z "$a" ] || ! is_loopback4 "$a"; then
            h=127.0.0.2
        fi
    fi
    a=$(resolve4 "$h")
    [ -n "$a" ] || die 4 "brick host '$h' does not resolve to an IPv4 address"
    # every address the name has must be loopback: gluster may use any of them
    for all in $(getent ahosts "$h" 2>/dev/null | awk '{print $1}' | sort -u); do
        if ! is_loopback4 "$all" && [ "$all" != ::1 ]; then
            die 4 "brick host '$h' resolves to $all, outside 127.0.0.0/8: refusing (nothing" \
                  "outside this machine may be contacted; set GLUSTER_HOST to a loopback name)"
        fi
    done
    is_loopback4 "$a" || die 4 "brick host '$h' resolves to $a, outside 127.0.0.0/8: refusing"
    HOST=$h
    ADDR=$a
}

# ---------------------------------------------------------------- glusterd
glusterd_pid() {
    local pid
    [ -f "$GLUSTER_RUN/glusterd.pid" ] || return 1
    pid=$(cat "$GLUSTER_RUN/glusterd.pid")
    alive "$pid" && [[ "$(cmdline_of "$pid")" == *glusterd* ]] && echo "$pid"
}

# The addresses glusterd (whoever started it) listens on, one a line.
glusterd_listen() { ss -Htlnp 2>/dev/null | awk '$4 ~ /:24007$/ {print $4}' | sed 's/:24007$//' | sort -u; }

configure_glusterd() {
    local cur
    mkdir -p "$GLUSTER_RUN"
    cur=$(awk '$1 == "option" && $2 == "transport.socket.bind-address" {print $3}' "$GLUSTERD_VOL")
    [ "$cur" = "$ADDR" ] && return 0
    [ -f "$GLUSTER_RUN/glusterd.vol.orig" ] || cp -p "$GLUSTERD_VOL" "$GLUSTER_RUN/glusterd.vol.orig"
    if [ -n "$cur" ]; then
        sed -i "s/^\([[:space:]]*option[[:space:]]\+transport\.socket\.bind-address[[:space:]]\+\).*/\1$ADDR/" \
            "$GLUSTERD_VOL"
    else
        sed -i "0,/^end-volume/s//    option transport.socket.bind-address $ADDR\nend-volume/" "$GLUSTERD_VOL"
    fi
    say "glusterd binds to $ADDR ($GLUSTERD_VOL)"
}

start_glusterd() {
    local pid listen i
    if pid=$(glusterd_pid); then
        return 0
    fi
    listen=$(glusterd_listen)
    if [ -n "$listen" ]; then
        # a glusterd this script did not start: use it only if it is on our loopback address
        [ "$listen" = "$ADDR" ] || die 4 "a glusterd not started by this script listens on" \
            "${listen//$'\n'/ } (port 24007); stop it first (this script binds glusterd to $ADDR only)"
        say "using the running glusterd on $ADDR:24007 (not started here: left running on down)"
        return 0
    fi
    configure_glusterd
    mkdir -p "$GLUSTER_RUN"
    rm -f "$GLUSTER_RUN/glusterd.pid"
    timeout -k 5 "$T" /usr/sbin/glusterd -p "$GLUSTER_RUN/glusterd.pid" --log-level INFO \
        || die 1 "glusterd did not start (/var/log/glusterfs/glusterd.log)"
    for i in $(seq 1 $((T * 10))); do
        if pid=$(glusterd_pid) && g volume list >/dev/null 2>&1; then
            say "glusterd started (pid $pid, $ADDR:24007)"
            return 0
        fi
        sleep 0.1
    done
    die 1 "glusterd does not answer within ${T}s (/var/log/glusterfs/glusterd.log)"
}

stop_glusterd_if_unused() {
    local pid
    mkdir -p "$GLUSTER_RUN/instances"
    if [ -n "$(ls -A "$GLUSTER_RUN/instances" 2>/dev/null)" ]; then
        local f names=""
        for f in "$GLUSTER_RUN"/instances/*; do names+=" ${f##*/}"; done
        say "glusterd left running: other volumes of this script are up:$names"
        return 0
    fi
    if pid=$(glusterd_pid); then
        stop_pid "$pid" glusterd || return 1
    fi
    rm -f "$GLUSTER_RUN/glusterd.pid"
    if [ -f "$GLUSTER_RUN/glusterd.vol.orig" ]; then
        cp -p "$GLUSTER_RUN/glusterd.vol.orig" "$GLUSTERD_VOL"
        say "restored $GLUSTERD_VOL"
    fi
    rm -rf "$GLUSTER_RUN"
}

# ---------------------------------------------------------------- bricks
brick_dir() { echo "$GLUSTER_DIR/bricks/b$1"; }

make_bricks() {
    local i d img dev
    mkdir -p "$GLUSTER_DIR/bricks"
    for i in $(seq 1 "$GLUSTER_BRICKS"); do
        d=$(brick_dir "$i")
        if [ -n "$GLUSTER_BRICK_SIZE" ]; then
            mkdir -p "$d.fs"
            if ! listed_mount "$d.fs"; then
                img="$GLUSTER_DIR/bricks/b$i.img"
                rm -f "$img"
                truncate -s "$GLUSTER_BRICK_SIZE" "$img"
                if command -v mkfs.ext4 >/dev/null && mkfs.ext4 -q -F -m 0 "$img" >/dev/null 2>&1 \
                    && timeout -k 5 "$T" mount -o loop "$img" "$d.fs" 2>/dev/null; then
                    dev=$(findmnt -n -o SOURCE "$d.fs")
                    echo "$d.fs $dev" >> "$STATE/loops"
                else
                    # no loop device here: a tmpfs of that size (it refuses O_DIRECT)
                    rm -f "$img"
                    timeout -k 5 "$T" mount -t tmpfs -o "size=$GLUSTER_BRICK_SIZE" tmpfs "$d.fs"
                    echo "$d.fs tmpfs" >> "$STATE/loops"
                fi
            fi
            # the brick is a directory inside the small file system (gluster keeps its
            # .glusterfs there; a mount point itself as brick needs an extra confirmation)
            d="$d.fs/brick"
        fi
        mkdir -p "$d"
        echo "$d"
    done
}

brick_paths() {
    local i
    for i in $(seq 1 "$GLUSTER_BRICKS"); do
        if [ -n "$GLUSTER_BRICK_SIZE" ]; then echo "$(brick_dir "$i").fs/brick"; else brick_dir "$i"; fi
    done
}

volume_exists() { g volume info "$GLUSTER_VOLUME" >/dev/null 2>&1; }
volume_brick_paths() { g volume info "$GLUSTER_VOLUME" 2>/dev/null | awk '/^Brick[0-9]+:/ {sub(/^[^:]*:/, "", $2); print $2}'; }

# Every brick of the volume still holds gluster's metadata. A run stopped halfway through
# `down` (or a reboot that took the loop-mounted bricks along) leaves glusterd a volume whose
# bricks are gone: it cannot start them again, and `up` would wait for them in vain.
volume_bricks_present() {
    local b
    for b in $(volume_brick_paths); do [ -d "$b/.glusterfs" ] || return 1; done
    return 0
}

# Delete a volume of this script whose bricks are gone (nothing is left to keep: its data was
# in them); a volume with bricks elsewhere is not this script's to delete.
drop_stale_volume() {
    local b
    for b in $(volume_brick_paths); do
        [[ "$b" == "$GLUSTER_DIR"/bricks/* ]] || die 1 "volume $GLUSTER_VOLUME has a brick" \
            "outside $GLUSTER_DIR ($b) that is gone; it is not this script's: delete it yourself"
    done
    say "volume $GLUSTER_VOLUME lost its bricks (a run stopped halfway, or a reboot): deleting it"
    g volume stop "$GLUSTER_VOLUME" force >/dev/null 2>&1 || true
    g volume delete "$GLUSTER_VOLUME" >/dev/null || die 1 "gluster volume delete $GLUSTER_VOLUME failed"
}
volume_started() { g volume info "$GLUSTER_VOLUME" 2>/dev/null | grep -q '^Status: Started'; }

# PIDs of the volume's brick processes, from glusterd's PID files
brick_pids() {
    local f pid
    for f in /var/run/gluster/vols/"$GLUSTER_VOLUME"/*.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f" 2>/dev/null || true)
        alive "$pid" && [[ "$(cmdline_of "$pid")" == *glusterfsd*"$GLUSTER_VOLUME"* ]] && echo "$pid"
    done
    return 0
}

wait_bricks_online() {
    local i n
    for i in $(seq 1 $((T * 10))); do
        n=$(g volume status "$GLUSTER_VOLUME" detail 2>/dev/null | grep -c '^Online.*: Y' || true)
        [ "$n" -ge "$GLUSTER_BRICKS" ] && return 0
        sleep 0.1
    done
    die 1 "the bricks of $GLUSTER_VOLUME are not online within ${T}s (/var/log/glusterfs/bricks/)"
}

# ---------------------------------------------------------------- the client mount
# Mounted: listed in the mount table. `mountpoint` stats the path, and the stat of a mount
# whose client died fails (ENOTCONN): such a dead mount is still there and must be detached.
is_mounted() { listed_mount "$GLUSTER_MOUNT"; }
listed_mount() { findmnt -rn --mountpoint "$1" >/dev/null 2>&1; }
# A mount that answers: its client is alive and talks to the volume.
mount_works() { timeout -k 5 "$T" stat -f "$GLUSTER_MOUNT" >/dev/null 2>&1; }

# Detach a mount whose client is gone (killed, crashed): every access to it fails with
# ENOTCONN until it is unmounted, and `mkdir`/`mount` on it fail.
detach_dead_mount() {
    is_mounted && ! mount_works || return 0
    say "$GLUSTER_MOUNT is a dead mount (its client is gone): detaching it"
    timeout -k 5 "$T" umount "$GLUSTER_MOUNT" 2>/dev/null || umount -l "$GLUSTER_MOUNT" 2>/dev/null \
        || die 1 "cannot detach the dead mount $GLUSTER_MOUNT"
}

client_pid() {
    local p
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        case "$(cmdline_of "$p")" in
            *glusterfs*--volfile-id=/"$GLUSTER_VOLUME"" $GLUSTER_MOUNT "*) alive "$p" && echo "$p" ;;
        esac
    done
    return 0
}

# ---------------------------------------------------------------- loopback check
check_loopback() {
    local bad
    # every TCP socket (listening or connected) of glusterd, the bricks and the clients
    bad=$(ss -Htanp 2>/dev/null | grep -E '"(glusterd|glusterfsd|glusterfs)"' \
        | awk '{print $4, $5}' | tr ' ' '\n' \
        | grep -vE '^(127\.[0-9.]+|\[::1\]|\[::ffff:127\.[0-9.]+\]):[0-9*]+$|^\*:\*$|^0\.0\.0\.0:\*$|^\[::\]:\*$' \
        | sort -u || true)
    if [ -n "$bad" ]; then
        echo "glusterfs.sh: gluster sockets outside 127.0.0.0/8:" >&2
        ss -Htanp | grep -E '"(glusterd|glusterfsd|glusterfs)"' >&2
        return 1
    fi
    return 0
}

# ---------------------------------------------------------------- up / down / status
cmd_up() {
    local why
    need_root
    check_dirs
    install_packages
    pick_host
    make_dirs
    echo "$HOST $ADDR" > "$STATE/host"
    start_glusterd
    mkdir -p "$GLUSTER_RUN/instances"
    echo "$GLUSTER_DIR" > "$GLUSTER_RUN/instances/$GLUSTER_VOLUME"
    if volume_exists && ! volume_bricks_present; then
        drop_stale_volume
    fi
    if ! volume_exists; then
        local bricks=() paths=() b
        rm -rf "$GLUSTER_DIR/bricks"/b*[0-9] "$GLUSTER_DIR/bricks"/b*.fs/brick 2>/dev/null || true
        mapfile -t paths < <(make_bricks) || true
        [ ${#paths[@]} = "$GLUSTER_BRICKS" ] || die 1 "could not make the bricks under $GLUSTER_DIR/bricks"
        for b in "${paths[@]}"; do bricks+=("$HOST:$b"); done
        g volume create "$GLUSTER_VOLUME" "${bricks[@]}" force >/dev/null \
            || die 1 "gluster volume create $GLUSTER_VOLUME ${bricks[*]} failed"
        touch "$STATE/created"
        say "created volume $GLUSTER_VOLUME: ${bricks[*]}"
    else
        make_bricks >/dev/null
    fi
    if ! volume_started; then
        g volume start "$GLUSTER_VOLUME" >/dev/null || die 1 "gluster volume start $GLUSTER_VOLUME failed"
        say "started volume $GLUSTER_VOLUME"
    fi
    wait_bricks_online
    brick_pids > "$STATE/bricks.pids"
    detach_dead_mount
    if ! is_mounted; then
        why=$(make_dir "$GLUSTER_MOUNT" 0755) || die 1 "cannot make GLUSTER_MOUNT $GLUSTER_MOUNT: $why"
        timeout -k 5 "$T" mount -t glusterfs "$HOST:/$GLUSTER_VOLUME" "$GLUSTER_MOUNT" \
            || die 1 "mount -t glusterfs $HOST:/$GLUSTER_VOLUME $GLUSTER_MOUNT failed" \
                     "(/var/log/glusterfs/$(echo "${GLUSTER_MOUNT#/}" | tr / -).log)"
        if ! is_mounted || ! mount_works; then
            die 1 "$GLUSTER_MOUNT is not a working mount after mount -t glusterfs"
        fi
        say "mounted $HOST:/$GLUSTER_VOLUME at $GLUSTER_MOUNT"
    fi
    client_pid > "$STATE/client.pid"
    check_loopback || die 4 "gluster talks to an address outside 127.0.0.0/8 (see above)"
    say "up: $HOST:/$GLUSTER_VOLUME ($ADDR) mounted at $GLUSTER_MOUNT"
}

cmd_down() {
    need_root
    check_dirs
    local rc=0 pid dev d pids=""
    # unmount: a plain umount lets the client exit by itself; lazy as the last resort
    if is_mounted; then
        pid=$(client_pid | head -n1)
        if ! timeout -k 5 "$T" umount "$GLUSTER_MOUNT" 2>/dev/null; then
            say "umount $GLUSTER_MOUNT failed or hung: detaching lazily"
            umount -l "$GLUSTER_MOUNT" 2>/dev/null || rc=1
        fi
        # the client exits by itself once unmounted; stopped by PID if it does not
        for _ in $(seq 1 50); do alive "$pid" || break; sleep 0.1; done
        [ -n "$pid" ] && { stop_pid "$pid" "gluster client" || rc=1; }
        say "unmounted $GLUSTER_MOUNT"
    fi
    for pid in $(cat "$STATE/client.pid" 2>/dev/null) $(client_pid); do
        stop_pid "$pid" "gluster client" || rc=1
    done
    # the volume, if glusterd knows it
    if command -v gluster >/dev/null && [ -n "$(glusterd_listen)" ] && volume_exists; then
        pids="$(brick_pids)"
        if volume_started; then
            g volume stop "$GLUSTER_VOLUME" force >/dev/null || { say "volume stop failed"; rc=1; }
        fi
        if g volume delete "$GLUSTER_VOLUME" >/dev/null; then
            say "deleted volume $GLUSTER_VOLUME"
        else
            say "volume delete failed"
            rc=1
        fi
    fi
    # brick processes still running (a hung or absent glusterd): by PID
    for pid in $pids $(cat "$STATE/bricks.pids" 2>/dev/null) $(brick_pids); do
        stop_pid "$pid" "brick process" || rc=1
    done
    rm -rf "/var/run/gluster/vols/$GLUSTER_VOLUME"
    # a volume definition glusterd could not delete (it was gone): only one this script made
    if [ -f "$STATE/created" ] && [ -d "/var/lib/glusterd/vols/$GLUSTER_VOLUME" ] \
        && [ -z "$(glusterd_listen)" ]; then
        rm -rf "/var/lib/glusterd/vols/$GLUSTER_VOLUME"
    fi
    # small bricks: their file systems
    if [ -f "$STATE/loops" ]; then
        while read -r d dev; do
            [[ $d == "$GLUSTER_DIR"/bricks/b*.fs ]] || continue
            if listed_mount "$d"; then
                timeout -k 5 "$T" umount "$d" 2>/dev/null || umount -l "$d" || rc=1
            fi
            if [ "$dev" != tmpfs ] && losetup "$dev" 2>/dev/null | grep -q "$GLUSTER_DIR"; then
                losetup -d "$dev" 2>/dev/null || true
            fi
        done < "$STATE/loops"
    fi
    rm -f "$GLUSTER_RUN/instances/$GLUSTER_VOLUME" 2>/dev/null || true
    if [ "$rc" = 0 ]; then
        if is_mounted; then rc=1; else rm -rf "$GLUSTER_DIR"; fi
    fi
    [ -d "$GLUSTER_RUN" ] && { stop_glusterd_if_unused || rc=1; }
    [ "$rc" = 0 ] && say "down: $GLUSTER_VOLUME removed" || echo "glusterfs.sh: down: not everything could be removed" >&2
    return "$rc"
}

cmd_status() {
    local pid up=0 parts=0
    if pid=$(glusterd_pid); then
        echo "glusterd: pid $pid, listening on $(glusterd_listen | tr '\n' ' ')"
    elif [ -n "$(glusterd_listen 2>/dev/null)" ]; then
        echo "glusterd: running (not started by glusterfs.sh), on $(glusterd_listen | tr '\n' ' ')"
    else
        echo "glusterd: not running"
    fi
    if command -v gluster >/dev/null && [ -n "$(glusterd_listen)" ] && volume_exists; then
        if volume_started; then
            echo "volume $GLUSTER_VOLUME: started, bricks: $(g volume info "$GLUSTER_VOLUME" \
                | awk '/^Brick[0-9]+:/ {print $2}' | tr '\n' ' ')"
            up=$((up + 1))
        else
            echo "volume $GLUSTER_VOLUME: created, not started"
        fi
        parts=$((parts + 1))
    else
        echo "volume $GLUSTER_VOLUME: absent"
    fi
    if is_mounted && ! mount_works; then
        echo "mounted: dead ($GLUSTER_MOUNT: its client is gone; up or down detaches it)"
        parts=$((parts + 1))
    elif is_mounted; then
        echo "mounted: $GLUSTER_MOUNT ($(findmnt -rn -o SOURCE --mountpoint "$GLUSTER_MOUNT"))"
        up=$((up + 1))
        parts=$((parts + 1))
    else
        echo "mounted: no ($GLUSTER_MOUNT)"
    fi
    [ -d "$GLUSTER_DIR" ] && parts=$((parts + 1))
    if [ "$up" = 2 ]; then
        check_loopback && echo "sockets: all on 127.0.0.0/8" || return 1
        return 0
    fi
    [ "$parts" = 0 ] && return 3
    return 1
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    install) need_root; install_packages ;;
    -h|--help|help) sed -n '2,/^set -euo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//' ;;
    *) echo "usage: glusterfs.sh up|down|status|install (see --help)" >&2; exit 2 ;;
esac
