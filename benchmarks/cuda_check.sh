#!/usr/bin/env bash
# One pass over what needs a GPU, as run on the lent H200 (see benchmarks/results/cuda-*.md):
# the test suite with the engine on CUDA (device "auto"), the Triton kernels against cuBLAS, and
# the core throughput / batch-1 benchmark against Hugging Face on the same GPU; with SSM=1 the
# recurrent decode kernels (tests/engine/test_ssm_kernels.py on CUDA, benchmarks/ssm_kernels.py).
# Expects python3 with torch (CUDA) and transformers; results go to $OUT (default /tmp/foudre-cuda).
set -u
OUT=${OUT:-/tmp/foudre-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"

echo "== core throughput (500M random Llama, bf16 and fp32; with and without CUDA graphs)"
timeout "${CORE_TIMEOUT:-150}" python3 benchmarks/core_throughput.py --device cuda \
    --dtypes bfloat16 float32 --compare-eager --out "$OUT/core-cuda.md" 2>&1 | grep -v "it/s]"

echo "== tests on CUDA"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q --timeout 90 -rfEs \
    --durations 10 tests/engine tests/oracles tests/spec tests/quant tests/loading tests/server \
    tests/cli tests/compress tests/bench > "$OUT/pytest-cuda.txt" 2>&1
echo "pytest exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-cuda.txt" | tail -n 40

if [ -n "${MOE:-}" ]; then
    echo "== Triton fused MoE against grouped cuBLAS"
    timeout "${MOE_TIMEOUT:-90}" python3 benchmarks/moe_kernels_cuda.py \
        --out "$OUT/moe-kernels-cuda.md" 2>&1 | tail -n 12
fi

if [ -n "${PREFILL:-}" ]; then
    echo "== long-prompt prefill: gather + masked SDPA against the Triton varlen kernel"
    timeout "${PREFILL_TIMEOUT:-300}" python3 benchmarks/long_prefill.py --device cuda \
        --lengths 2048 16384 --out "$OUT/long-prefill-cuda" 2>&1 | tail -n 12
fi

if [ -n "${KERNELS:-}" ]; then
    echo "== Triton weight-only kernels"
    timeout "${KERNEL_TIMEOUT:-70}" python3 benchmarks/quant_kernels_cuda.py \
        --out "$OUT/quant-kernels-cuda.md" 2>&1 | tail -n 25
fi

if [ -n "${SSM:-}" ]; then
    echo "== recurrent decode kernels (Triton) against their torch references"
    timeout "${SSM_TIMEOUT:-120}" python3 -m pytest -p no:cacheprovider -q -rfEs \
        tests/engine/test_ssm_kernels.py -k triton 2>&1 | tail -n 5
    timeout "${SSM_TIMEOUT:-120}" python3 benchmarks/ssm_kernels.py --device cuda \
        --rows 1 32 256 2>&1 | tee "$OUT/ssm-kernels-cuda.md" | tail -n 12
fi
