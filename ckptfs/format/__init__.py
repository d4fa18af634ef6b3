"""The on-disk format: index records and log headers (records.py), the backing directory and
its writers (backing.py), reading runs back (logs.py). docs/format.md describes it for people."""
