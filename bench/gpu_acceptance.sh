#!/usr/bin/env bash
# The GPU acceptance runs, in stages of under ten minutes each:
#
#   bash bench/gpu_acceptance.sh STAGE OUTDIR
#
#   tests     tests/gpu and the gpu-marked kernel tests (separate processes: an engine
#             test leaves no state behind, but a failing one should not hide the others)
#   profile   decode-step profiles (batch 1, 64, 256), a prefill round's profile (8 prompts
#             alone and beside 56 decodes), served decode steps traced (batch 1,
#             64), the batch-1 GEMV against cuBLAS with its SwiGLU and RoPE/KV epilogues, the
#             skinny GEMM (2-64 rows) against cuBLAS, plain and with its SwiGLU epilogue
#   llama     the full fixed-1k sweep on the Llama-3.1-8B shape
#   qwen3     the full fixed-1k sweep on the Qwen3-8B shape
#   peer      HF generate_batch in the same run (c=64, 64 x 1024/1024)
#   grammar   structured-output overhead (8B shape and the built-in model)
#   flashinfer  the optional FlashInfer backend (needs flashinfer-python): its decode
#             profile and fixed-1k at c=1 and 64 on the Llama shape, beside the Triton runs
#
# Every engine run has the data-plane checks at error: a host sync or a Triton compile on
# the serving path ends it. Results (JSON + logs) land in OUTDIR; docs/performance.md says
# how they were read.
set -o pipefail
stage=${1:?stage: tests|profile|llama|qwen3|peer|grammar|flashinfer}
out=${2:?output directory}
mkdir -p "$out"
export TOKENSPEED_DATA_PLANE_SYNC_DEBUG=error TOKENSPEED_JIT_COMPILE_CHECK=error

case "$stage" in
tests)
    python3 -m pytest -q -p no:cacheprovider tests/gpu --tb=short 2>&1 | tee "$out/gpu-tests.log"
    python3 -m pytest -q -p no:cacheprovider kernels/tests -m gpu --tb=short 2>&1 | tee "$out/kernel-tests.log"
    ;;
profile)
    python3 bench/decode_profile.py --batch 1,64,256 --out "$out/decode-profile.json"
    python3 bench/prefill_profile.py --out "$out/prefill-profile.json"
    python3 bench/serving_trace.py --batch 1 --out "$out/serving-trace-b1.json"
    python3 bench/serving_trace.py --batch 64 --out "$out/serving-trace-b64.json"
    python3 kernels/bench_gemv.py --json "$out/gemv.json"
    python3 kernels/bench_gemv.py --silu-mul --json "$out/gemv-silu-mul.json"
    python3 kernels/bench_gemv.py --rope-kv --json "$out/gemv-rope-kv.json"
    python3 kernels/bench_skinny_gemm.py --json "$out/skinny-gemm.json"
    python3 kernels/bench_skinny_gemm.py --silu-mul --json "$out/skinny-gemm-silu-mul.json"
    ;;
llama | qwen3)
    python3 -m tokenspeed_aio bench fixed-1k --shape "$stage-8b" --out "$out/fixed-1k-$stage-8b.json"
    ;;
peer)
    python3 -m tokenspeed_aio bench fixed-1k --shape llama-8b --concurrency 64 --num-requests 64 \
        --input-len 1024 --output-len 1024 --peer hf --out "$out/peer-hf-llama8b.json"
    ;;
flashinfer)
    python3 bench/decode_profile.py --batch 1,64 --attention-backend flashinfer \
        --out "$out/decode-profile-flashinfer.json"
    python3 -m tokenspeed_aio bench fixed-1k --shape llama-8b --concurrency 1,64 \
        --attention-backend flashinfer --out "$out/fixed-1k-llama-8b-flashinfer.json"
    ;;
grammar)
    python3 bench/grammar_overhead.py --shape llama-8b --out "$out/grammar-llama8b.json"
    python3 bench/grammar_overhead.py --out "$out/grammar-default.json"
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
