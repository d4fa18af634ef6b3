"""Fault injection for the tests of what a defect costs: with CKPTFS_FAILPOINT=NAME:N in the
daemon's environment, the Nth time the code passes failpoint NAME it raises an unexpected
exception (RuntimeError). Never set in use. The failpoints: `flusher-commit` (the flusher
thread's commit), `loader` (a loader thread's job), `cleaner` (a step of the maintenance)."""

from __future__ import annotations

import os

_NAME, _, _N = os.environ.get("CKPTFS_FAILPOINT", "").partition(":")
_passes: dict[str, int] = {}


def hit(name: str) -> None:
    """Raise RuntimeError on the Nth pass of failpoint `name` when it is the one set."""
    if name != _NAME:
        return
    n = _passes[name] = _passes.get(name, 0) + 1
    if n == int(_N or 1):
        raise RuntimeError(f"failpoint {name} reached")
