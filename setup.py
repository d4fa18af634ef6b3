# The cffi extension (API mode, compiled against the system liburing) needs setup();
# everything else lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["ckptfs/io/_uring_build.py:ffibuilder"])
