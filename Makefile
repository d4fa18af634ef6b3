# One-command setup: `make demo` and `make test` install what is missing, then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEB_PKGS := fuse3 libfuse3-dev liburing-dev pkg-config gcc python3-dev python3-venv shellcheck iproute2 \
	mount e2fsprogs
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
STAMP := $(VENV)/.ckptfs-installed
WORKERS := -n 2

.PHONY: setup deps gluster-deps gluster-up gluster-down demo test test-quick soak bench lint clean

# (the package's bytecode is written here even where PYTHONDONTWRITEBYTECODE is set: else
# every daemon start compiles it again, ~90 ms of each mount)
setup: deps $(STAMP)
	@$(PY) -m compileall -q ckptfs

# Debian packages, only when one is missing (apt-get update once, then install).
deps:
	@missing=""; for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		$(SUDO) apt-get update -q && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

# The virtual environment; torch is pinned so that this machine takes its CPU build.
# (the C module: io/_uring_build.py builds it from these sources and headers)
C_SOURCES := $(wildcard ckptfs/io/*.c ckptfs/io/*.h ckptfs/fuse/*.c ckptfs/fuse/*.h)

$(STAMP): pyproject.toml setup.py ckptfs/io/_uring_build.py $(C_SOURCES)
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# GlusterFS, loopback only (docs/glusterfs.md): the packages for the tests marked glusterfs,
# and a volume mounted at /var/tmp/ckptfs-gluster/mnt to try ckptfs over.
gluster-deps:
	@dpkg -s glusterfs-server glusterfs-client >/dev/null 2>&1 || $(SUDO) mount_scripts/glusterfs.sh install \
		|| echo "GlusterFS packages not installed: the tests marked glusterfs will be skipped"

gluster-up:
	$(SUDO) mount_scripts/glusterfs.sh up

gluster-down:
	$(SUDO) mount_scripts/glusterfs.sh down

demo: setup
	$(VENV)/bin/ckptfs demo

# The tests where the transport matters run a second time with every mount on FUSE over
# io_uring (--fuse-uring; the kernel's switch on for that run: tests/conftest.py; skipped where
# the kernel has none): requests in flight, in-place WRITEs and READ payloads, interrupts, a
# daemon killed under its rings, torch.save/load through it. What the handlers decide (the
# namespace model, permissions, limits, other writers' views, a full disk) is the same code
# behind either transport and runs once; tests/test_fuse_uring.py compares the two directly.
# The kill-9 test runs fewer rounds there (each round a kill at a random point).
URING_TESTS = tests/test_fastpath.py tests/test_request_loop.py tests/test_fs_posix.py \
	tests/test_fs_torch.py tests/test_fs_concurrency.py tests/test_direct_reads.py \
	tests/test_reader.py tests/test_crash.py tests/test_eio.py

# (the suite stays near 15 minutes on this VM: 6 kill -9 rounds of the crash tests and 4 of
# the cleaner's in the first pass, 3 over io_uring, where the tests marked either_transport
# are left out: their mounts are not on the rings, or what they test is below the daemon;
# `CKPTFS_CRASH_ITERS=50 .venv/bin/python -m pytest tests/test_crash.py` looks longer)
# Two workers (pytest-xdist; tests/conftest.py says what runs together in one).
test: setup gluster-deps
	CKPTFS_CRASH_ITERS=6 CKPTFS_LIFECYCLE_CRASH_ITERS=4 $(PY) -m pytest -q $(WORKERS)
	CKPTFS_TEST_FUSE_URING=1 CKPTFS_CRASH_ITERS=3 $(PY) -m pytest -q $(WORKERS) \
		-m 'not either_transport' $(URING_TESTS)

test-quick: setup
	$(PY) -m pytest -q -m 'not slow'

soak: setup
	CKPTFS_SOAK_S=600 $(PY) -m pytest -q tests/test_load.py

# fio is a contender of the benchmark (the disk's own O_DIRECT write of the same bytes)
bench: setup
	@dpkg -s fio >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -q fio; }
	$(VENV)/bin/ckptfs bench e2e

lint: setup
	$(PY) -m pip install -q ruff && $(VENV)/bin/ruff check ckptfs tests

clean:
	rm -rf $(VENV) build *.egg-info ckptfs/io/*.so ckptfs/io/_uring_cffi.c ckptfs/io/*.o ckptfs/fuse/*.o
