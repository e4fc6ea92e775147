#!/usr/bin/env bash
# The L2 host tier's GPU runs (one H200, Llama-3.1-8B shape, dummy weights), in stages that
# each take under four minutes:
#
#   bash bench/host_tier_gpu.sh STAGE OUTDIR        STAGE: tests | restore | multiturn | all
#
#   tests      tests/gpu/test_gpu_host_tier.py: greedy tokens with the tier on (both
#              policies, depth 0 and 1, retraction by restore and load-backs asserted)
#              equal the tier off and transformers in fp32
#   restore    bench/retraction_restore.py: a 4096-token victim stored and restored
#              through the host tiers against recomputing it (a 4096-token prefill)
#   multiturn  the multi-turn long-context workload (16 conversations: an 8192-token
#              context, then 3 turns of 256 tokens, 128-token replies; a 152k-token working
#              set) with the device pool at a quarter of it (2400 blocks of 16 = 38k tokens)
#              and the host pool at 5x the device pool (12k blocks, 23 GiB pinned), the tier
#              off and on in one run
#
# The data-plane checks are at error throughout: a host sync or a Triton compile on the
# serving path fails the run. Results (JSON + logs) land in OUTDIR.
set -o pipefail
stage=${1:?stage: tests|restore|multiturn|all}
out=${2:?output directory}
mkdir -p "$out"
export TOKENSPEED_DATA_PLANE_SYNC_DEBUG=error TOKENSPEED_JIT_COMPILE_CHECK=error

run_tests() {
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_host_tier.py --tb=short 2>&1 \
        | tee "$out/host-tier-gpu-tests.log"
}
run_restore() {
    python3 bench/retraction_restore.py --shape llama-8b --tokens 4096 --repeats 5 \
        --out "$out/retraction-restore-llama-8b-4k-h200.json" 2>&1 | tee "$out/retraction-restore.log"
}
run_multiturn() {
    python3 -m tokenspeed_aio bench long-context-chat --shape llama-8b \
        --conversations 16 --turns 4 --context-tokens 8192 --turn-tokens 256 --reply-tokens 128 \
        --num-kv-blocks 2400 --max-model-len 16384 --max-num-seqs 32 \
        --kvstore-compare 0,5 --no-roofline \
        --out "$out/long-context-chat-llama-8b-l2-h200.json" 2>&1 | tee "$out/long-context-chat.log"
}
case "$stage" in
tests) run_tests ;;
restore) run_restore ;;
multiturn) run_multiturn ;;
all) run_tests; run_restore; run_multiturn ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
