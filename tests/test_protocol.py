"""fuse/protocol.h is one definition for both sides: the layouts and constants Python code
reads from it (fuse/protocol.py) are the C compiler's (the compiled module's), and the header
reader refuses what it cannot lay out as C does."""

import pytest

from ckptfs.fuse import protocol
from ckptfs.io.uring import ffi, lib

pytestmark = pytest.mark.skipif(lib is None, reason="ckptfs.io._uring_cffi is not built")


@pytest.mark.parametrize("name", sorted(protocol.LAYOUTS))
def test_layouts_are_the_compilers(name):
    layout = protocol.layout(name)
    assert layout.size == ffi.sizeof(f"struct {name}")
    for field, offset in layout.offsets.items():
        assert offset == ffi.offsetof(f"struct {name}", *field.split(".")), field


def test_constants_are_the_modules():
    assert protocol.CONSTANTS
    for name, value in protocol.CONSTANTS.items():
        if name.startswith("CKPTFS_"):
            continue
        assert getattr(lib, name) == value, name


def test_replies_pack_the_attributes_flat():
    fields = (7, 4096, 8, -1, 2, 3, 4, 5, 6, 0o100644, 1, 1000, 1000, 0, 512 << 10, 0)
    out = protocol.ENTRY_OUT.pack(7, 0, 1, 300, 0, 0, *fields)
    assert len(out) == ffi.sizeof("struct fuse_entry_out")
    e = ffi.cast("struct fuse_entry_out *", ffi.from_buffer(out))
    assert (e.attr.ino, e.attr.atime, e.attr.mode, e.attr.blksize) == (7, -1, 0o100644, 512 << 10)


def test_the_reader_refuses_padding_and_unknown_fields():
    with pytest.raises(ValueError, match="padding"):
        protocol.parse("struct a { uint32_t x; uint64_t y; };")
    with pytest.raises(ValueError, match="padding at its end"):
        protocol.parse("struct a { uint64_t x; uint32_t y; };")
    with pytest.raises(ValueError, match="cannot read"):
        protocol.parse("struct a { uint32_t x, y; };")
    constants, layouts = protocol.parse("#define A 0x10 /* sixteen */\nstruct b { uint16_t c[3];"
                                        " uint16_t d; };")
    assert constants == {"A": 16} and layouts["b"].offsets == {"c": 0, "d": 6}
