"""Benchmarks: `ckptfs bench engine|micro|e2e`. Each module has `main(argv) -> int`."""
