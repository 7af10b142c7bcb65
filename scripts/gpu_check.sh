#!/usr/bin/env bash
# The GPU path, proven on a machine with CUDA, from a plain checkout (no install: PYTHONPATH=src):
#   bash scripts/gpu_check.sh OUTDIR
# writes to OUTDIR: doctor.txt and doctor.json (ddpkit doctor), gpu-tests.log and gpu-tests.xml (pytest
# tests/gpu, marker gpu), bench.log, bench.json and bench/ (ddpkit bench --device cuda --report: the table and
# its plots), and summary.txt. Exit code: 0 when the doctor and every GPU test passed.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
{
    echo "ddpkit GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    "$py" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
} > "$out/summary.txt"
"$py" -m ddpkit doctor > "$out/doctor.txt" 2>&1; doctor=$?
"$py" -m ddpkit doctor --json > "$out/doctor.json" 2>/dev/null
"$py" -m pytest tests/gpu -m gpu -q -rA --junitxml "$out/gpu-tests.xml" > "$out/gpu-tests.log" 2>&1; tests=$?
bench=1
if [ "$gpus" -gt 0 ]; then
    "$py" -m ddpkit bench --device cuda --world-size "$gpus" --workloads convnet mlp transformer resnet linear200 \
        --steps 100 --no-progress --json "$out/bench.json" --report "$out/bench" > "$out/bench.log" 2>&1
    bench=$?
else
    echo "no CUDA device: the GPU bench was not run" > "$out/bench.log"
fi
{
    echo "GPUs: $gpus"
    echo "doctor: exit $doctor"
    echo "tests/gpu: exit $tests ($(tail -n 1 "$out/gpu-tests.log"))"
    echo "bench: exit $bench"
} >> "$out/summary.txt"
cat "$out/summary.txt"
[ "$doctor" -eq 0 ] && [ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
