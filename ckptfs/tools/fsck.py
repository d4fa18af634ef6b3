"""`ckptfs fsck`: rebuild a writer's index from what is left of it and from the copies of its
commit groups in the data logs (records.copy_block), when the index is damaged or lost.

The index is a chain of commit groups, each ending with a COMMIT that carries the sequence
number of its last change; a group starts where the one before it ended. The scan keeps every
group the damage did not touch (records.scan_index resumes after a damaged stretch) and marks
the first group after each stretch. Each copy block says where its groups start. So:

  - walk the index's groups in order; where a group follows damage (or the index is gone), take
    the copies that continue the chain from the last group kept, until they reach that group;
  - after the index's last group, take the copies that continue the chain (a truncated index,
    one whose last groups were damaged, an index lost whole);
  - a stretch that neither the index nor a copy holds is reported as lost (the sequence
    numbers it spans); the groups after it are still applied, record by record, as replay
    always does (a record naming something the lost stretch created is skipped with a
    warning).

Nothing is invented: every record of the result was written by the writer, in the index or in
a copy. The data is not read (`ckptfs verify` checks every run's checksum). The rebuilt index
replaces the old one atomically; the old one is kept beside it (index.log.damaged-<crc32c>).
Copies live in data logs until the cleaner gives their space back (punched or cleaned logs):
groups older than that can come only from the index.
"""

from __future__ import annotations

import os
import sys

from ckptfs.format import backingdir, records
from ckptfs.format.backingdir import WriterDir
from ckptfs.format.index import keep_damaged, write_fresh
from ckptfs.format.logs import read_copies
from ckptfs.format.records import CommitRec, FormatError, NumbersRec
from ckptfs.namespace import Namespace
from ckptfs.replay import replay

# (a torn tail is a crash's, never acknowledged nor copied: not damage)
DAMAGE = (records.GROUP_SKIPPED, records.INDEX_ENDED)


class _Group:
    __slots__ = ("upto", "records", "time", "source")

    def __init__(self, upto: int, recs: list, time_ns: int, source: str) -> None:
        self.upto, self.records, self.time, self.source = upto, recs, time_ns, source


def copies_of(writer_dir: str) -> dict[int, _Group]:
    """The commit groups the data logs hold copies of, by the sequence number each starts
    after (a later copy of the same start wins: the writer went on from there again)."""
    out: dict[int, _Group] = {}
    for number, path in sorted(backingdir.data_logs(writer_dir).items()):
        try:
            blocks = list(read_copies(path, number))
        except OSError:
            continue
        for _, start, body in blocks:
            scan = records.scan_index(path, records.index_header(records.INDEX_VERSION) + body)
            for recs, upto, when in zip(scan.groups, scan.group_seqs, scan.group_times):
                out[start] = _Group(upto, recs, when, f"copy in data log {number}")
                start = upto
    return out


def rebuild(index_path: str | None, copies: dict[int, _Group]) -> tuple[list[_Group], dict]:
    """The chain of commit groups (see the module's docstring) and what was found: groups
    from the index and from copies, the sequence ranges lost, the scan's warnings."""
    scan = records.IndexScan()
    if index_path is not None and os.path.exists(index_path):
        try:
            scan = records.read_index(index_path)
        except FormatError as exc:  # (a header that is not an index's: only copies)
            scan.warnings.append(str(exc))
    chain: list[_Group] = []
    lost: list[tuple[int, int]] = []
    s = 0  # the sequence number the chain has reached
    from_copies = 0

    def follow(until: int | None) -> None:
        nonlocal s, from_copies
        while s in copies and (until is None or copies[s].upto < until):
            g = copies[s]
            if g.upto <= s:
                break
            chain.append(g)
            s = g.upto
            from_copies += 1

    first = True
    for recs, upto, when, after in zip(scan.groups, scan.group_seqs, scan.group_times,
                                       scan.group_after_damage):
        snapshot = first and any(type(r) is NumbersRec for r in recs)
        if first and not after and (snapshot or s == 0):
            pass  # (the index's start: from 0, or a snapshot standing for all before it)
        elif after or first:
            follow(upto)
            if not (s in copies and copies[s].upto == upto) and s < upto:
                lost.append((s, upto))
        first = False
        if upto <= s and chain:
            continue  # (already there, from the copies)
        chain.append(_Group(upto, recs, when, "index"))
        s = upto
    follow(None)
    damaged = [w for w in scan.warnings if getattr(w, "kind", None) in DAMAGE]
    found = {"index_groups": sum(g.source == "index" for g in chain),
             "copied_groups": from_copies, "lost": lost,
             "damage": [str(w) for w in scan.warnings], "damaged": bool(damaged),
             "index_missing": index_path is None or not os.path.exists(index_path)}
    return chain, found


def _encode(chain: list[_Group]) -> tuple[bytes, int]:
    version = 1
    parts = []
    for g in chain:
        for r in g.records:
            t = type(r)
            if t in records.CROSS_WRITER_RECORDS:
                version = max(version, records.CROSS_INDEX_VERSION)
            elif t in (records.RetireRec, NumbersRec):
                version = max(version, records.RETIRE_INDEX_VERSION)
            parts.append(records.encode(r))
        parts.append(records.encode(CommitRec(g.upto, g.time)))
    return b"".join(parts), version


def fsck_writer(backing: str, writer: str, dry_run: bool = False) -> dict:
    """Rebuild writer `writer`'s index (it must not be mounted: its lock is taken)."""
    wd = WriterDir(backing, writer)
    wd.open()
    try:
        index_path = wd.dir.join(backingdir.INDEX_NAME)
        chain, found = rebuild(index_path, copies_of(wd.path))
        found["writer"] = writer
        changed = found["damaged"] or found["copied_groups"] or found["index_missing"]
        found["rewritten"] = bool(changed) and not dry_run
        if found["rewritten"]:
            blob, version = _encode(chain)
            if not found["index_missing"]:
                found["kept"] = keep_damaged(wd.dir, backingdir.INDEX_NAME)
            tmp = backingdir.INDEX_NAME + ".fsck"
            write_fresh(tmp, blob, version, where=wd.dir)
            wd.dir.rename(tmp, backingdir.INDEX_NAME)
            wd.dir.sync()
        if not dry_run:
            ns = Namespace(now_ns=0)
            if os.path.exists(index_path):
                _, _, warnings = replay(ns, index_path)
                found["replay_warnings"] = [str(w) for w in warnings]
            found["files"] = sum(1 for x in ns.inodes.values() if x.emap is not None)
        return found
    finally:
        wd.close()


def cmd_fsck(a) -> int:
    """Exit 0: nothing was damaged; 1: repaired, with nothing lost; 2: something is lost."""
    writers = [a.writer] if a.writer else [
        os.path.basename(d) for d in backingdir.writer_dirs(a.backing)]
    if not writers:
        print(f"{a.backing}: no writer")
        return 0
    worst = 0
    for w in writers:
        f = fsck_writer(a.backing, w, a.dry_run)
        for d in f["damage"]:
            print(f"{w}: {d}", file=sys.stderr)
        state = ("clean" if not (f["damaged"] or f["copied_groups"] or f["index_missing"])
                 else "would be rebuilt" if a.dry_run else "rebuilt")
        print(f"{w}: {state}: {f['index_groups']} commit groups from the index, "
              f"{f['copied_groups']} from copies in the data logs"
              + (f", {f['files']} files" if "files" in f else "")
              + (f"; the damaged index is kept as {f['kept']}" if "kept" in f else ""))
        for a_, b in f["lost"]:
            print(f"{w}: LOST: the changes after {a_} up to {b} are in neither the index nor "
                  "a copy", file=sys.stderr)
        worst = max(worst, 2 if f["lost"] else 1 if state != "clean" else 0)
    return worst
