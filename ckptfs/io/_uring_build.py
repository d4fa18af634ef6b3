"""cffi API-mode builder for ``ckptfs.io._uring_cffi``: the one C module, the one that links
the system liburing. It holds the io_uring engine's C layer (io/uring.c) and the FUSE queue
threads (fuse/ring*.c) with their CRC32C (fuse/crc32c.c). Its declarations are the text of
the headers the C includes (CDEF_HEADERS), so Python and C share one definition of every
struct and call.

Used by setup.py (``cffi_modules=["ckptfs/io/_uring_build.py:ffibuilder"]``). If liburing is
missing at install time (no header, no library: checked by compiling and linking a tiny probe
program), the install does not fail: the module is built from STUB_SOURCES instead, whose
functions all fail with ENOSYS, and ``ckptfs.io.open_engine("auto")`` falls back to the
posix engine and logs the build-time reason (``ck_build_info()``).  CKPTFS_BUILD_NO_URING=1 at
build time forces the stub (to test that path).  A C compiler is still required, as for any
cffi API-mode module (and for pyfuse3).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
FUSE_DIR = os.path.join(HERE, "..", "fuse")
# What the cffi module declares: the headers' text, as the C includes it. The io_uring
# engine's (io/uring.h); FUSE's wire protocol (fuse/protocol.h, for its layouts to be checked
# against protocol.py's: tests/test_protocol.py); the queue threads' (fuse/ring.h), with
# their CRC32C.
CDEF_HEADERS = [os.path.join(HERE, "uring.h"), os.path.join(FUSE_DIR, "protocol.h"),
                os.path.join(FUSE_DIR, "ring.h")]
# The C: the engine; the queue threads, one file per job (fuse/ring.c: what both transports
# share; ring_dev.c: /dev/fuse; ring_uring.c: FUSE over io_uring; ring_landing.c: landed
# writes; ring_dirs.c: directory attributes, names and CREATE; ring_reads.c: prepared
# LOOKUPs, read windows, OPEN and READ); their CRC32C (no liburing in it: the stub has it).
URING_SOURCES = [os.path.join(HERE, "uring.c")] + [
    os.path.join(FUSE_DIR, name) for name in (
        "ring.c", "ring_dev.c", "ring_uring.c", "ring_landing.c", "ring_dirs.c",
        "ring_reads.c")]
STUB_SOURCES = [os.path.join(HERE, "uring_stub.c"), os.path.join(FUSE_DIR, "ring_stub.c")]
CRC_SOURCES = [os.path.join(FUSE_DIR, "crc32c.c")]
# (relative to where the build runs, the source tree: an absolute path would put the objects
# under build/temp.../<that path>)
URING_SOURCES, STUB_SOURCES, CRC_SOURCES = (
    [os.path.relpath(p) for p in paths] for paths in (URING_SOURCES, STUB_SOURCES, CRC_SOURCES))


def cdef_of(text: str) -> str:
    """A header's declarations as cffi's cdef reads them: without the preprocessor lines
    other than `#define NAME number` (include guards, includes)."""
    out = []
    for line in text.splitlines():
        if line.startswith("#") and not re.match(r"#define\s+\w+\s+(0[xX][0-9a-fA-F]+|\d+)\b",
                                                 line):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


_PROBE = r"""
#include <liburing.h>
int main(void) { struct io_uring r; return io_uring_queue_init(1, &r, 0) < 0; }
"""


def _pkg_config() -> tuple[list[str], list[str], str]:
    """(cflags, libs, version) for liburing: pkg-config if it knows it, else -luring."""
    if shutil.which("pkg-config"):
        try:
            def run(*args: str) -> str:
                return subprocess.run(["pkg-config", *args, "liburing"], check=True,
                                      capture_output=True, text=True).stdout.strip()
            return shlex.split(run("--cflags")), shlex.split(run("--libs")), run("--modversion")
        except (OSError, subprocess.CalledProcessError):
            pass
    return [], ["-luring"], "unknown"


def _c_compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _probe_liburing(cflags: list[str], libs: list[str]) -> str | None:
    """None if a program using liburing compiles and links here, else the reason it does not."""
    if os.environ.get("CKPTFS_BUILD_NO_URING"):
        return "built without io_uring (CKPTFS_BUILD_NO_URING set at build time)"
    with tempfile.TemporaryDirectory(prefix="ckptfs-uring-probe-") as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(_PROBE)
        cmd = _c_compiler() + [src, "-o", os.path.join(tmp, "probe")] + cflags + libs
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            # No usable compiler for the probe: let the real build try (and fail loudly).
            return None
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["?"])[0]
            return ("built without io_uring: liburing headers/library not usable at build "
                    "time (%s)" % first)
    return None


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


_cflags, _libs, _version = _pkg_config()
_stub_reason = _probe_liburing(_cflags, _libs)

ffibuilder = FFI()
for _path in CDEF_HEADERS:
    with open(_path) as _f:
        ffibuilder.cdef(cdef_of(_f.read()))
# (the module's own C: the declarations its wrappers call; the functions are in the sources)
_MAIN = '#include "uring.h"\n#include "protocol.h"\n#include "ring.h"\n'
if _stub_reason is None:
    ffibuilder.set_source(
        "ckptfs.io._uring_cffi",
        _MAIN,
        sources=URING_SOURCES + CRC_SOURCES,
        include_dirs=[HERE, FUSE_DIR],
        define_macros=[("CK_URING_VERSION", _c_string(_version)), ("_GNU_SOURCE", None)],
        extra_compile_args=["-O2"] + _cflags,
        extra_link_args=_libs + ["-pthread"],
    )
else:
    ffibuilder.set_source(
        "ckptfs.io._uring_cffi",
        _MAIN,
        sources=STUB_SOURCES + CRC_SOURCES,
        include_dirs=[HERE, FUSE_DIR],
        define_macros=[("CK_STUB_REASON", _c_string(_stub_reason))],
        extra_compile_args=["-O2"],
        extra_link_args=["-pthread"],
    )


if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
