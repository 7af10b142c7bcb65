#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch==2.13.0 (the CPU
# build this machine carries; any other torch spec pulls several GB of CUDA
# wheels), then ddpkit itself in editable mode with its test and docs extras
# (the suite builds the docs site with mkdocs --strict) and the optional
# integrations' (lightning, tensorboard), so that their tests run.
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
if ! .venv/bin/python -c "import torch, ddpkit, pytest, xdist, coverage, tqdm, safetensors, sklearn, matplotlib, mkdocs, mkdocstrings, material, lightning, tensorboard" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet "${find_links[@]}" torch==2.13.0
    .venv/bin/python -m pip install --quiet "${find_links[@]}" -e ".[test,docs,lightning,tensorboard]"
fi
