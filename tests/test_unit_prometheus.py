"""The Prometheus text file without a mount: prometheus_text's output, read back by
prometheus_client's own parser, follows the exposition format's conventions (HELP and TYPE
for every family, counters end in _total, sizes in _bytes, times in _seconds) and escapes
label values."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import parser

from ckptfs.metrics import INFO_LABELS, METRICS, NOT_METRICS, prometheus_text


def status(**extra) -> dict:
    """A status dictionary with every figure METRICS knows (values 1, 2, 3, ...), the words
    and flags of ckptfs_info, and `extra`."""
    st = {"pid": 4242, "backing": "/lustre/run42", "mountpoint": "/ckpt", "writer": "node1",
          "engine": "io_uring", "io_mode": "direct", "readonly": False, "direct_reads": True,
          "shared_mmap_of_direct_files": True, "transport": "io_uring", "flush_gbps": 1.5,
          "durability": "backing", "tier_local_dir": "/nvme/ckptfs",
          "last_error": "", "ring_error": "",
          "forwarded_by_opcode": {"3": 7}}
    st.update({key: i + 1 for i, key in enumerate(METRICS)})
    st.update(extra)
    return st


def families(text: str) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def test_every_figure_has_help_type_and_a_conventional_name():
    fams = families(prometheus_text(status()))
    names = {f"ckptfs_{m[0]}": (m[1], key) for key, m in METRICS.items()}
    seen = set()
    for fam in fams.values():
        assert fam.documentation, fam.name
        for sample in fam.samples:
            seen.add(sample.name)
            if sample.name == "ckptfs_info":
                continue
            kind, key = names[sample.name]
            assert fam.type == kind, sample.name
            assert sample.labels == {"mountpoint": "/ckpt", "writer": "node1"}
            scale = METRICS[key][3] if len(METRICS[key]) > 3 else 1  # to the base unit
            assert sample.value == pytest.approx((list(METRICS).index(key) + 1) * scale)
            assert sample.name.endswith("_total") == (kind == "counter"), sample.name
            if key.endswith(("_s", "_ms", "_seconds")):
                assert "_seconds" in sample.name, sample.name
            if "bytes" in key:
                assert "_bytes" in sample.name, sample.name
    assert seen == set(names) | {"ckptfs_info"}  # one sample per figure, nothing else


def test_words_and_flags_are_labels_of_info():
    fams = families(prometheus_text(status()))
    (info,) = fams["ckptfs_info"].samples
    assert info.value == 1
    assert info.labels == {"mountpoint": "/ckpt", "writer": "node1", "pid": "4242",
                           "backing": "/lustre/run42", "engine": "io_uring",
                           "io_mode": "direct", "readonly": "false", "direct_reads": "true",
                           "shared_mmap_of_direct_files": "true", "transport": "io_uring",
                           "durability": "backing", "tier_local_dir": "/nvme/ckptfs"}
    assert set(info.labels) - {"mountpoint", "writer"} == set(INFO_LABELS)
    for key in NOT_METRICS | {"last_error", "forwarded_by_opcode", "readonly", "ring_error"}:
        assert f"ckptfs_{key}" not in fams


def test_label_values_are_escaped():
    odd = '/mnt/a "quoted" \\ back\nslash'
    fams = families(prometheus_text(status(mountpoint=odd, backing=odd)))
    sample = fams["ckptfs_inodes"].samples[0]
    assert sample.labels["mountpoint"] == odd
    assert fams["ckptfs_info"].samples[0].labels["backing"] == odd


def test_a_figure_without_a_type_goes_out_untyped():
    fams = families(prometheus_text(status(brand_new_figure=5)))
    fam = fams["ckptfs_brand_new_figure"]
    assert fam.type == "unknown" and fam.samples[0].value == 5


def test_docs_list_every_metric_with_its_type():
    doc = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    section = doc.split("### Prometheus\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if line.startswith("| `ckptfs_") and len(cells) == 4:
            rows[cells[0]] = (cells[1], cells[2])
    want = {f"ckptfs_{m[0]}": (m[1], key) for key, m in METRICS.items()}
    assert {k: v for k, v in rows.items() if k != "ckptfs_info"} == want
