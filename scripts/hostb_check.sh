#!/usr/bin/env bash
# One device-tool run on a lent GPU machine (docs/benchmarks.md §4, §6): the CUDA checks (Triton kernels natively,
# tests/test_cuda.py) beside the native screen's per-path checks on that machine's CPU (host B: AVX-512 VNNI):
# tests/test_native_paths.py, then the differential fuzzer with each kernel path forced, one process per path.
# Usage: bash scripts/hostb_check.sh [CASES_PER_PATH]   (writes logs and JSON under ${OUT:-hostb_out})
set -u
CASES=${1:-500}
OUT=${OUT:-hostb_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)|^Flags' | sed -E 's/^Flags:.*/&/' ;
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$OUT/env.txt" 2>&1
grep -v '^Flags' "$OUT/env.txt"; grep -o -E 'avx512_vnni|avx_vnni|avx512f ' "$OUT/env.txt" | sort -u | tr '\n' ' '; echo
pids=()
for p in avx2 avxvnni avx512vnni; do
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 HF_CSV_SCREEN_PATH=$p HF_CSV_FUZZ_CASES=$CASES HF_CSV_FUZZ_JSON="$OUT/fuzz_$p.json" \
    timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_differential.py > "$OUT/fuzz_$p.log" 2>&1 &
  pids+=($!)
done
CUDA_VISIBLE_DEVICES= timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_native_paths.py > "$OUT/native_paths.log" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py > "$OUT/triton_tests.log" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > "$OUT/cuda_tests.log" 2>&1
wait "${pids[@]}"
for f in native_paths triton_tests cuda_tests fuzz_avx2 fuzz_avxvnni fuzz_avx512vnni; do echo "== $f"; tail -4 "$OUT/$f.log"; done
for p in avx2 avxvnni avx512vnni; do [ -f "$OUT/fuzz_$p.json" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); s=d['summary']; print(sys.argv[1], {k: s[k] for k in ('cases','certified','declined','mismatches')})" "$OUT/fuzz_$p.json"; done
