"""FUSE's wire protocol for Python code: the opcodes, flags and layouts of fuse/protocol.h.

The header is the one definition: the queue threads' C (fuse/ring*.c) includes it, and this
module reads it when it is imported (a few hundred lines, well under a millisecond), so the
fast path and the queue threads cannot disagree on a number or an offset. Every
`#define NAME number` there is a constant of this module (FUSE_LOOKUP, FOPEN_NOFLUSH, ...);
every struct is a `Layout`: a little-endian `struct.Struct` of its fields in order (a nested
struct's fields in its place, an array as one bytes field) and the offset of each field,
nested ones by dotted name ("ring_ent_in_out.payload_sz"). The header's structs have no
implicit padding, which is checked here, so the Python format has the C compiler's offsets;
tests/test_protocol.py compares both with the compiled module's.

Any thread may use it: it holds constants only.
"""

from __future__ import annotations

import os
import re
import struct
from typing import NamedTuple

HEADER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.h")

# C field types -> struct codes (an array of any of them is one bytes field)
_CODES = {"uint64_t": "Q", "int64_t": "q", "uint32_t": "I", "int32_t": "i",
          "uint16_t": "H", "uint8_t": "B", "char": "c"}
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_DEFINE = re.compile(r"^#define\s+(\w+)\s+(0[xX][0-9a-fA-F]+|\d+)\s*$", re.M)
_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*\{(.*?)\}\s*;", re.S)
_FIELD = re.compile(r"^\s*((?:struct\s+)?\w+)\s+(\w+)\s*(?:\[(\d+)\])?\s*;\s*$")


class Layout(NamedTuple):
    """A struct of protocol.h: its Python format and where each of its fields lies."""

    name: str
    struct: struct.Struct
    offsets: dict[str, int]  # field (nested: "outer.inner") -> byte offset
    align: int

    @property
    def size(self) -> int:
        return self.struct.size

    def offset(self, field: str) -> int:
        return self.offsets[field]

    def prefix(self, last: str) -> struct.Struct:
        """The fields up to and including top-level field `last`: for a struct the kernel
        sends shorter to older versions (fuse_init_out)."""
        end = self.offsets[last] + _size_of_field(self, last)
        fmt, size = "<", 0
        for code in _codes(self.struct.format):
            if size >= end:
                break
            fmt += code
            size = struct.calcsize(fmt)
        return struct.Struct(fmt)


def _codes(fmt: str) -> list[str]:
    """The format's fields, one code each ("<QI16s" -> ["Q", "I", "16s"])."""
    return re.findall(r"\d*[a-zA-Z]", fmt.lstrip("<"))


def _size_of_field(layout: Layout, field: str) -> int:
    later = [o for o in layout.offsets.values() if o > layout.offsets[field]]
    return (min(later) if later else layout.size) - layout.offsets[field]


def parse(text: str) -> tuple[dict[str, int], dict[str, Layout]]:
    """The integer constants and the struct layouts of a header in protocol.h's subset of C."""
    text = _COMMENT.sub("", text)
    constants = {name: int(value, 0) for name, value in _DEFINE.findall(text)}
    layouts: dict[str, Layout] = {}
    for name, body in _STRUCT.findall(text):
        fmt, offsets, at, align = "<", {}, 0, 1
        for line in filter(str.strip, body.split(";")):
            m = _FIELD.match(line + ";")
            if m is None:
                raise ValueError(f"protocol.h: struct {name}: cannot read {line.strip()!r}")
            ctype, field, count = m.group(1), m.group(2), m.group(3)
            if ctype.startswith("struct"):
                inner = layouts[ctype.split()[1]]
                # (flattened: a reply packs the inner fields with the outer ones)
                code, size, falign = inner.struct.format[1:], inner.size, inner.align
                offsets.update({f"{field}.{k}": at + v for k, v in inner.offsets.items()})
            else:
                one = struct.calcsize("<" + _CODES[ctype])
                size, falign = one * int(count or 1), one
                code = f"{size}s" if count else _CODES[ctype]
            if at % falign:
                raise ValueError(f"protocol.h: struct {name}.{field} needs padding before it")
            offsets[field] = at
            fmt += code
            at += size
            align = max(align, falign)
        if at % align:
            raise ValueError(f"protocol.h: struct {name} needs padding at its end")
        layouts[name] = Layout(name, struct.Struct(fmt), offsets, align)
    return constants, layouts


with open(HEADER_PATH) as _f:
    CONSTANTS, LAYOUTS = parse(_f.read())
globals().update(CONSTANTS)


def layout(name: str) -> Layout:
    """The layout of `struct name` in protocol.h."""
    return LAYOUTS[name]


# The layouts the fast path packs and unpacks per request, as struct.Struct
IN_HEADER = LAYOUTS["fuse_in_header"].struct
OUT_HEADER = LAYOUTS["fuse_out_header"].struct
READ_IN = LAYOUTS["fuse_read_in"].struct
WRITE_IN = LAYOUTS["fuse_write_in"].struct
WRITE_OUT = LAYOUTS["fuse_write_out"].struct
FLUSH_IN = LAYOUTS["fuse_flush_in"].struct
RELEASE_IN = LAYOUTS["fuse_release_in"].struct
INTERRUPT_IN = LAYOUTS["fuse_interrupt_in"].struct
OPEN_IN = LAYOUTS["fuse_open_in"].struct
OPEN_OUT = LAYOUTS["fuse_open_out"].struct
CREATE_IN = LAYOUTS["fuse_create_in"].struct
ATTR = LAYOUTS["fuse_attr"].struct
ATTR_OUT = LAYOUTS["fuse_attr_out"].struct
ENTRY_OUT = LAYOUTS["fuse_entry_out"].struct
INIT_IN = LAYOUTS["fuse_init_in"].struct
# fuse_init_out up to max_write: the reply's length before 7.23
INIT_OUT = LAYOUTS["fuse_init_out"].prefix("max_write")
