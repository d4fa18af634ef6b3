"""`ckptfs verify`: read every live extent of a backing directory and check its checksum."""

from __future__ import annotations

import sys

from ckptfs.format.logs import RunReader
from ckptfs.format.records import DATA_LOSS
from ckptfs.namespace import ROOT_INO
from ckptfs.tools.snapshot import Progress, Snapshot


def cmd_verify(a) -> int:
    """Read every extent of every file and check its checksum. Exit 1 if anything is damaged."""
    snap = Snapshot(a.backing, a.writer)
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not snap.union.writer_dirs:
        print(f"{a.backing}: empty (no writer yet)")
        return 0
    logs = RunReader(snap.union.writer_dirs)
    problems: dict[str, list[str]] = {}
    files = [(p, x) for p, x in snap.walk(snap.ns.inodes[ROOT_INO], "") if x.emap is not None]
    prog = Progress(sum(x.emap.stored_bytes() for _, x in files), "verify")
    nbytes = 0
    try:
        for path, x in files:
            for run in x.emap.runs():
                try:
                    nbytes += len(logs.read_run(run))
                except OSError as exc:
                    problems.setdefault(path, []).append(str(exc.strerror or exc))
                prog.add(run.length)
    finally:
        logs.close()
        prog.finish()
    for path, msgs in sorted(problems.items()):
        for m in msgs:
            print(f"DAMAGED {path}: {m}")
    lost = [w for w in snap.warnings if getattr(w, "kind", None) in DATA_LOSS]
    status = "OK" if not problems and not lost else "DAMAGED"
    print(f"{status}: {len(files)} files, {nbytes} bytes checked, {len(problems)} damaged files, "
          f"{len(snap.warnings)} index warnings")
    return 0 if status == "OK" else 1
