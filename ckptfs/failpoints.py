"""Fault injection for the tests of what a defect costs: with CKPTFS_FAILPOINT=NAME:N in the
daemon's environment, the Nth time the code passes failpoint NAME it raises an unexpected
exception (RuntimeError). Never set in use. The failpoints: `flusher-commit` (the flusher
thread's commit), `loader` (a loader thread's job), `cleaner` (a step of the maintenance),
`drain` (a cycle of the node tier's drain), `handover` (the trio thread taking a request the
queue threads handed over: FastPath.serve_ring), `statfs` (a request handler pyfuse3 calls:
CkptOperations.statfs).

With CKPTFS_HOLD=NAME:PATH, the code waits at hold point NAME while the file PATH exists: the
tests hold the node tier's drain (`drain`) to see changes that are node-durable only, and a
chunk load of the read path (`loader`) to keep a READ in flight."""

from __future__ import annotations

import os

_NAME, _, _N = os.environ.get("CKPTFS_FAILPOINT", "").partition(":")
_passes: dict[str, int] = {}
_HOLD, _, _HOLD_PATH = os.environ.get("CKPTFS_HOLD", "").partition(":")


def hit(name: str) -> None:
    """Raise RuntimeError on the Nth pass of failpoint `name` when it is the one set."""
    if name != _NAME:
        return
    n = _passes[name] = _passes.get(name, 0) + 1
    if n == int(_N or 1):
        raise RuntimeError(f"failpoint {name} reached")


def held(name: str) -> bool:
    """Whether hold point `name` is held now (CKPTFS_HOLD names it and its file exists)."""
    return name == _HOLD and bool(_HOLD_PATH) and os.path.exists(_HOLD_PATH)
