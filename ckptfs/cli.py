"""The `ckptfs` command. Each subcommand parses its own options and calls into the package."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHES = ("engine", "micro", "e2e")


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print("usage: ckptfs bench {%s} [options]   (ckptfs bench NAME --help)" % "|".join(BENCHES),
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    mod = importlib.import_module(f"ckptfs.bench.{argv[0]}")
    return mod.main(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="ckptfs")
    parser.add_argument("command", choices=["bench"])
    parser.parse_args(argv)
    return 0
