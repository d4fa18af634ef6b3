"""The offline commands, one module each: ls, verify, export, import, compact, gc."""
