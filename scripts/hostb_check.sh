#!/usr/bin/env bash
# One device-tool run on a lent GPU machine (docs/benchmarks.md §4, §6): the CUDA checks (Triton kernels natively,
# tests/test_stack_cuda.py) beside the native screen's per-path checks on that machine's CPU (host B: AVX-512 VNNI):
# tests/test_kernels_native.py, then the differential fuzzer with each kernel path forced, SHARDS processes per path
# (cases split by HF_CSV_FUZZ_START), one thread each.
# Usage: bash scripts/hostb_check.sh [CASES_PER_PATH] [SHARDS]   (writes logs and JSON under ${OUT:-hostb_out})
set -u
CASES=${1:-500}; SHARDS=${2:-1}
OUT=${OUT:-hostb_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)|^Flags' ;
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$OUT/env.txt" 2>&1
grep -v '^Flags' "$OUT/env.txt"; grep -o -E 'avx512_vnni|avx_vnni|avx512f ' "$OUT/env.txt" | sort -u | tr '\n' ' '; echo
# a shard runs CASES/SHARDS cases at about 7 a second on one core of host B; leave room for the model builds
LIMIT=$(( CASES / SHARDS / 5 + 90 ))
pids=()
for p in avx2 avxvnni avx512vnni; do
  for ((s = 0; s < SHARDS; s++)); do
    a=$(( CASES * s / SHARDS )); b=$(( CASES * (s + 1) / SHARDS ))
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 HF_CSV_SCREEN_PATH=$p HF_CSV_FUZZ_START=$a HF_CSV_FUZZ_CASES=$b \
      HF_CSV_FUZZ_JSON="$OUT/fuzz_${p}_$s.json" timeout $LIMIT python3 -m pytest -q -p no:cacheprovider \
      tests/test_stack_differential.py > "$OUT/fuzz_${p}_$s.log" 2>&1 &
    pids+=($!)
  done
done
CUDA_VISIBLE_DEVICES= timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_native.py -k "kernel_path or forced_path or selection_skips or self_test_catches" > "$OUT/native_paths.log" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton_ops.py tests/test_kernels_dispatch.py::test_dispatch_picks_triton_only_on_cuda > "$OUT/triton_tests.log" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_stack_cuda.py > "$OUT/cuda_tests.log" 2>&1
wait "${pids[@]}"
for f in native_paths triton_tests cuda_tests; do echo "== $f"; tail -3 "$OUT/$f.log"; done
for p in avx2 avxvnni avx512vnni; do echo "== fuzz $p"; tail -q -n 1 "$OUT"/fuzz_${p}_*.log; done
python3 - "$OUT" <<'PY'
import glob, json, sys
for p in ("avx2", "avxvnni", "avx512vnni"):
    tot = {"cases": 0, "certified": 0, "declined": 0, "mismatches": 0}
    files = sorted(glob.glob(f"{sys.argv[1]}/fuzz_{p}_*.json"))
    for f in files:
        s = json.load(open(f))["summary"]
        for k in tot:
            tot[k] += s[k]
    print(p, "shards with a summary:", len(files), tot)
PY
