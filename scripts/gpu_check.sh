#!/usr/bin/env bash
# The CUDA checks, one run on a lent GPU machine (device tool): Triton kernels natively, the certified head and
# generate against stock on the device (tests/test_stack_cuda.py), and the head-level timings (scripts/bench_kernels.py).
# Needs torch with CUDA, triton, pytest, transformers 5.20-5.23 (a wheel in .whl/ is installed to /tmp/site first).
# Writes logs and JSON under ${OUT:-gpu_out}.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)';
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/env.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton_ops.py tests/test_kernels_dispatch.py::test_dispatch_picks_triton_only_on_cuda 2>&1 | tee "$OUT/triton_tests.log" | tail -25
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_stack_cuda.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -25
for vd in "151936 1536" "262144 640" "128256 4096"; do set -- $vd
  timeout 60 python3 scripts/bench_kernels.py --json "$OUT/kernels_${1}x${2}.json" --vocab "$1" --hidden "$2" --reps 50 2>&1 | tail -30
done
timeout 90 python3 scripts/profile_head.py --vocab 151936 --hidden 1536 --dtype bf16 2>&1 | tee "$OUT/profile_head.txt" | grep -E "median|per call|Self CUDA time total|Self CPU time total"
for dt in bf16 fp32; do
  timeout 150 python3 scripts/bench_cuda_generate.py --dtype $dt --json "$OUT/generate_$dt.json" 2>&1 | tail -40
done
