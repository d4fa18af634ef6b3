# shellcheck shell=bash
# Sourced by the scripts here that run as root (slurm-prolog.sh, slurm-epilog.sh,
# glusterfs.sh): the one test of whether root alone controls a path, and the one way they
# create a directory. Bash. Lies beside them, in the installation only root can change.

# trusted PATH [in]: root alone decides what PATH is. PATH and every directory and symlink on
# the way to it belong to root; no directory on the way is writable by anyone else unless it is
# sticky (there no one else can move or remove root's entries); PATH itself is writable by no
# one else, or with "in" (a directory to create something in) only if it is sticky.
# Prints the reason and fails when it is not so.
trusted() {
    local path=$1 in=${2:-} rest=$1 cur=/ c t st uid mode type hops=0
    case "$path" in /*) ;; *) echo "$path is not an absolute path"; return 1 ;; esac
    while :; do
        rest=${rest#"${rest%%[!/]*}"}
        st=$(stat -c '%u %a %F' -- "$cur" 2>/dev/null) || { echo "$cur does not exist"; return 1; }
        read -r uid mode type <<< "$st"
        [ "$uid" = 0 ] || { echo "$cur belongs to uid $uid, not root"; return 1; }
        if (( 8#$mode & 8#022 )); then
            if (( !(8#$mode & 8#1000) )) || { [ -z "$rest" ] && [ -z "$in" ]; }; then
                echo "$cur is writable by others (mode $mode)"
                return 1
            fi
        fi
        [ -n "$rest" ] || return 0
        [ "$type" = directory ] || { echo "$cur is not a directory"; return 1; }
        c=${rest%%/*}
        rest=${rest#"$c"}
        case "$c" in
            .) continue ;;
            ..) cur=$(dirname -- "$cur"); continue ;;
        esac
        cur=${cur%/}/$c
        if [ -L "$cur" ]; then
            uid=$(stat -c %u -- "$cur")
            [ "$uid" = 0 ] || { echo "$cur is a symlink of uid $uid, not root's"; return 1; }
            hops=$((hops + 1))
            [ "$hops" -le 40 ] || { echo "$path: too many symlinks"; return 1; }
            t=$(readlink -- "$cur")
            rest=$t/$rest
            case "$t" in /*) cur=/ ;; *) cur=$(dirname -- "$cur") ;; esac
        fi
    done
}

# make_dir DIR MODE: DIR is afterwards a directory only root can change. A missing DIR (and its
# missing parents, 0755) is created by mkdir, never through a symlink nor in a directory someone
# else can change; mkdir fails on whatever else got there first, which is then checked and
# refused. Prints the reason and fails when it cannot be so.
make_dir() {
    local d=$1 parent out
    parent=$(dirname -- "$d")
    if [ ! -e "$d" ] && [ ! -L "$d" ]; then
        if [ ! -e "$parent" ] && [ ! -L "$parent" ]; then
            make_dir "$parent" 0755 || return 1
        fi
        out=$(trusted "$parent" in) || { echo "$out"; return 1; }
        out=$(mkdir -m "$2" -- "$d" 2>&1) || { echo "$out"; return 1; }
    fi
    out=$(trusted "$d") || { echo "$out"; return 1; }
    [ -d "$d" ] || { echo "$d is not a directory"; return 1; }
}

# source_trusted FILE: FILE read as shell when it exists and root alone controls it (trusted; a
# missing FILE is fine). Fails with the reason in $trust_why otherwise.
source_trusted() {
    trust_why=""
    [ -e "$1" ] || [ -L "$1" ] || return 0
    trust_why=$(trusted "$1") || { trust_why="not reading $1: $trust_why"; return 1; }
    [ -f "$1" ] || { trust_why="not reading $1: not a regular file"; return 1; }
    # shellcheck source=/dev/null
    . "$1"
}
