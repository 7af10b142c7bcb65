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
# The mpi backend's tests need an MPI library and its launcher: Debian's Open MPI (mpi4py, from the mpi extra,
# loads its libmpi.so.40). Installed with apt-get when this runs as root; otherwise said, and those tests skip.
if ! command -v mpirun >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q openmpi-bin >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q openmpi-bin >/dev/null 2>&1; } \
            || echo "scripts/setup.sh: apt-get install openmpi-bin failed (no package index reachable?): the mpi backend's tests will skip" >&2
    else
        echo "scripts/setup.sh: no mpirun here, and installing Open MPI needs root and apt-get (apt-get install openmpi-bin): the mpi backend's tests will skip" >&2
    fi
fi
if ! .venv/bin/python -c "import torch, ddpkit, pytest, xdist, coverage, tqdm, safetensors, sklearn, matplotlib, mkdocs, mkdocstrings, material, lightning, tensorboard, mpi4py" >/dev/null 2>&1 \
        || ! .venv/bin/python -c "from importlib.metadata import entry_points as e; assert e(group='ddpkit.backends', name='mpi')" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet "${find_links[@]}" torch==2.13.0
    .venv/bin/python -m pip install --quiet "${find_links[@]}" -e ".[test,docs,lightning,tensorboard,mpi]"
fi
