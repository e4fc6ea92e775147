#!/usr/bin/env bash
# FP8 on the H200 (every stage bounded; `all` -- the tables and both Llama stages -- stays
# under 9 minutes, one device call; qwen3-block and profile take another):
#
#   bash bench/fp8_acceptance.sh STAGE OUTDIR        STAGE: all | tables | tests | llama-fp8 |
#                                                           llama-bf16 | qwen3-block | profile
#
#   tables       kernels/bench_fp8_gemm.py --write-config: the FP8 kernels' picks per Llama
#                shape (Triton tiles vs torch._scaled_mm) into this GPU's fp8_gemv / fp8_gemm
#                tables (Qwen3's block-scaled entries stay as they are), then
#                kernels/bench_fp8_swiglu.py --write-config: the gate/up product's SwiGLU
#                epilogue where it beats the SwiGLU launch (the fp8_gemm_silu_mul table);
#                the written files are copied to OUTDIR/configs/
#   tests        the gpu-marked FP8 kernel tests
#   llama-fp8    fixed-1k 1000/1000 on Llama-3.1-8B, compressed-tensors per-channel FP8
#                weights (dummy) + FP8 KV cache: c=1 (batch-1 TPOT), c=64, c=512 (max
#                throughput; the FP8 pool holds 512 x 2000 tokens)
#   llama-bf16   the same levels on bf16 weights and cache, in the same call
#   qwen3-block  Qwen3-8B with 128x128 block FP8 weights (the fp8 format): c=1 and c=64
#   profile      decode-step profiles by kernel (batch 1 and 64) of both FP8 shapes
#
# Every engine run has both data-plane checks at error. Each stage writes its own JSON/log
# under OUTDIR, so a failing stage loses nothing of the others; the table at the end is
# bench/fp8_summary.py's.
set -o pipefail
stage=${1:?stage}
out=${2:?output directory}
mkdir -p "$out"
export TOKENSPEED_DATA_PLANE_SYNC_DEBUG=error TOKENSPEED_JIT_COMPILE_CHECK=error
export PYTHONPATH="$PWD/src:$PWD/kernels:$PYTHONPATH"
LEN=(--input-len 1000 --output-len 1000 --workload-seed 7)

run() {  # name, timeout seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee -a "$out/stages.log"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/stages.log"
}

stage_tables() {
    run tables 150 python3 kernels/bench_fp8_gemm.py --models llama --write-config \
        --budget-s 110 --json "$out/fp8-gemm-h200.json"
    run swiglu-table 50 python3 kernels/bench_fp8_swiglu.py --buckets 32 64 --write-config \
        --json "$out/fp8-swiglu-h200.json"
    mkdir -p "$out/configs"
    cp -r kernels/tokenspeed_kernels/configs/fp8_gemv kernels/tokenspeed_kernels/configs/fp8_gemm \
        kernels/tokenspeed_kernels/configs/fp8_gemm_silu_mul "$out/configs/" 2>/dev/null
}
stage_tests() {
    run tests 120 python3 -m pytest -q -p no:cacheprovider kernels/tests/test_kernel_fp8.py \
        kernels/tests/test_kernel_fp8_kv.py -m gpu --tb=short
}
stage_llama_fp8() {
    run fixed-1k-llama-8b-fp8-kvfp8 160 python3 -m tokenspeed_aio bench fixed-1k \
        --shape llama-8b-fp8 --kv-cache-dtype fp8 "${LEN[@]}" --concurrency 1,64,512 \
        --num-requests 3,128,512 --max-num-seqs 512 \
        --out "$out/fixed-1k-llama-8b-fp8-kvfp8.json"
}
stage_llama_bf16() {
    run fixed-1k-llama-8b-bf16 160 python3 -m tokenspeed_aio bench fixed-1k \
        --shape llama-8b "${LEN[@]}" --concurrency 1,64,512 --num-requests 3,128,512 \
        --max-num-seqs 512 --out "$out/fixed-1k-llama-8b-bf16.json"
}
stage_qwen3_block() {
    run fixed-1k-qwen3-8b-fp8-block 100 python3 -m tokenspeed_aio bench fixed-1k \
        --shape qwen3-8b-fp8-block "${LEN[@]}" --concurrency 1,64 --num-requests 3,128 \
        --max-num-seqs 64 --out "$out/fixed-1k-qwen3-8b-fp8-block.json"
}
stage_profile() {
    run decode-profile-llama-8b-fp8 120 python3 bench/decode_profile.py --shape llama-8b-fp8 \
        --kv-cache-dtype fp8 --batch 1,64 --out "$out/decode-profile-llama-8b-fp8.json"
    run decode-profile-qwen3-8b-fp8-block 120 python3 bench/decode_profile.py \
        --shape qwen3-8b-fp8-block --batch 1,64 --out "$out/decode-profile-qwen3-8b-fp8-block.json"
}

case "$stage" in
all)
    stage_tables
    stage_llama_fp8
    stage_llama_bf16
    ;;
tables) stage_tables ;;
tests) stage_tests ;;
llama-fp8) stage_llama_fp8 ;;
llama-bf16) stage_llama_bf16 ;;
qwen3-block) stage_qwen3_block ;;
profile) stage_profile ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
python3 bench/fp8_summary.py "$out" | tee "$out/summary.md"
