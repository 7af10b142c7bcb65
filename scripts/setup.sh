#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch==2.13.0 (the CPU
# build this machine carries; any other torch spec pulls several GB of CUDA
# wheels), then ddpkit itself in editable mode with its test and docs extras
# (the suite builds the docs site with mkdocs --strict) and the optional
# integrations' (lightning, tensorboard) and the mpi backend's (mpi4py, and Open MPI from Debian), so that their
# tests run.
# A second run only checks that everything imports and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# The CPU wheel of torch 2.13.0 lies in /opt/wheels on these machines; name it
# explicitly rather than trust PIP_FIND_LINKS to be in the environment.
find_links=()
if [ -d /opt/wheels ]; then
    find_links=(--find-links /opt/wheels)
fi
# The mpi backend's tests need MPI libraries and their launchers: Debian's Open MPI (mpi4py, from the mpi extra,
# loads its libmpi.so.40; its mpirun stays the default one) and MPICH (tests/comm/test_mpich.py). Installed with
# apt-get when this runs as root; otherwise said, and those tests skip. MPICH without its recommended -dev package:
# that one would make libmpi.so MPICH's where Open MPI's -dev is absent, and mpi4py would load MPICH by default.
need_mpi() {  # need_mpi COMMAND PACKAGE [APT OPTIONS]
    command -v "$1" >/dev/null 2>&1 && return 0
    local command=$1 package=$2
    shift 2
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q "$@" "$package" >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" "$package" >/dev/null 2>&1; } \
            || echo "scripts/setup.sh: apt-get install $package failed (no package index reachable?): its tests will skip" >&2
    else
        echo "scripts/setup.sh: no $command here, and installing it needs root and apt-get (apt-get install $package): its tests will skip" >&2
    fi
}
need_mpi mpirun openmpi-bin
need_mpi mpiexec.mpich mpich --no-install-recommends
if ! .venv/bin/python -c "import torch, ddpkit, pytest, xdist, coverage, tqdm, safetensors, sklearn, matplotlib, mkdocs, mkdocstrings, material, lightning, tensorboard, mpi4py" >/dev/null 2>&1 \
        || ! .venv/bin/python -c "from importlib.metadata import entry_points as e; assert e(group='ddpkit.backends', name='mpi')" >/dev/null 2>&1 \
        || ! .venv/bin/python -c "import pytest; assert tuple(map(int, pytest.__version__.split('.')[:2])) < (9, 2)" >/dev/null 2>&1; then
    # (pytest 9.2's node ids make pytest-xdist 3.8's --dist loadgroup ignore every group, pytest-xdist#1386:
    # pyproject.toml's test extra keeps pytest below it, and a venv made before the pin is brought under it here)
    .venv/bin/python -m pip install --quiet "${find_links[@]}" torch==2.13.0
    .venv/bin/python -m pip install --quiet "${find_links[@]}" -e ".[test,docs,lightning,tensorboard,mpi]"
fi
