#!/usr/bin/env bash
# Every GPU check and measurement behind benchmarks/RESULTS.md, in one place, stage by stage.
#
#   bash benchmarks/run_all.sh OUT_DIR [STAGE ...]
#
# Stages (default: all, in this order; each has its own time limit and log OUT_DIR/<stage>.log):
#   test       the CUDA-only tests (kernels against references, graph replay = eager, no host sync)
#   tune       tile tables: fused MoE (small M with the in-kernel slot sum; GEMM 2 searched separately at
#              prefill sizes), the dense GEMV against cuBLAS, the quantized dense GEMV, the quantized MoE
#              decode paths
#   e2e        moerun bench, bf16 with a per-kernel profile and transformers side by side; then Q4_K_M
#   kernels    bench_moe.py and bench_quant_moe.py tables
#   offload    bench_offload.py, both modes, with transformers + accelerate at 8 GiB; the host part of copy mode
#   pdl        batch-1 decode, bf16 and Q4_K_M, without PDL and with each trigger point (kernels/pdl.py)
#   quant      Q4_K_M only: tune the quantized dense GEMV and MoE decode tables, then batch-1 decode with a profile
#   gguf-offload  the quantized-offload GPU tests, then the Q4_K_M rows alone in copy and zero-copy mode
#   variants  batch-1 decode, bf16 and Q4_K_M (one build each): the q/k norm inside the decode attention launch
#             (MOERUN_DECODE_QK_FUSED=1) and every kernel in PDL mode 2 against the default; Q4_K_M also with q|k
#             and v in two launches (MOERUN_QUANT_JOINT=0)
#   prefill-quant  the Q4_K table at M = 1 ... 4096 (prefill sizes: tile against dequant + bf16), then Q4_K_M prefill
#   pending    what RESULTS lists as not yet measured: the GPU tests of the grid types' tile kernels, MXFP4 and the
#              fused router's int8 slices; their MoE layers (grid tiles on and off); Q4_K_M batch-1 decode with a
#              profile (the router's line); IQ2_M (grid tiles on and off) and MXFP4_MOE end to end
# Tuned tables are written into src/moerun/kernels/configs/ (copy them back into the repository).
set -uo pipefail
out=${1:?usage: run_all.sh OUT_DIR [STAGE ...]}
shift
stages=${*:-test tune e2e kernels offload}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

run() {  # run STAGE SECONDS COMMAND...: time-limited, logged, never stops the other stages
    local stage=$1 limit=$2
    shift 2
    echo "== $stage: $*" | tee -a "$out/$stage.log"
    timeout "$limit" "$@" 2>&1 | tee -a "$out/$stage.log" | tail -40
}

for stage in $stages; do
    case $stage in
    test)
        run test 420 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/test_cuda_graphs.py \
            tests/test_gguf_model.py tests/offload/test_zero_copy.py tests/offload/test_offload_generation.py \
            tests/offload/test_packed_pool.py \
            tests/test_async_scheduling.py tests/test_bench.py ;;
    tune)
        run tune 240 python3 benchmarks/tune_moe.py --shape qwen3-30b-a3b --quick --m 1 2 4 8 16 32 64 \
            --log-dir "$out/tune_logs"
        run tune 300 python3 benchmarks/tune_moe.py --shape qwen3-30b-a3b --quick --gemm2 --m 1024 2048 4096 \
            --log-dir "$out/tune_logs"
        run tune 300 python3 benchmarks/tune_gemv.py --shape qwen3-30b-a3b --quick
        run tune 300 python3 benchmarks/tune_quant_gemv.py --preset qwen3-30b-a3b-q4_k_m --quick \
            --log-dir "$out/tune_logs"
        run tune 420 python3 benchmarks/bench_quant_moe.py --tune --tune-types Q4_K_M Q6_K Q8_0 \
            --types Q4_K_M Q6_K Q8_0 --m 1 2 4 8 --out "$out/quant_tune"
        run tune 240 python3 benchmarks/bench_quant_moe.py --tune --tune-types Q4_K_M --types Q4_K_M --H 4096 \
            --I 1536 --m 1 2 4 8 --out "$out/quant_tune_235b" ;;
    e2e)
        run e2e 540 python3 -m moerun.cli bench --preset qwen3-30b-a3b --prefill-lens 128,512,2048,8192 \
            --batch-sizes 1,8,64 --max-model-len 9216 --steps 32 --profile --vs transformers --hf-batch-sizes 1 \
            --out "$out/bench_bf16"
        run e2e 300 python3 -m moerun.cli bench --preset qwen3-30b-a3b --quant Q4_K_M --prefill-lens 512,2048 \
            --batch-sizes 1,8,64 --max-model-len 4096 --steps 32 --profile --out "$out/bench_q4km" ;;
    kernels)
        run kernels 420 python3 benchmarks/bench_moe.py --budget-s 0.15 --kernels --out "$out/bench_moe"
        run kernels 420 python3 benchmarks/bench_quant_moe.py --types Q4_K Q6_K Q8_0 --m 1 4 64 1024 4096 \
            --out "$out/bench_quant" ;;
    offload)
        run offload 560 python3 benchmarks/bench_offload.py --modes zero_copy,copy --gguf-modes copy,zero_copy \
            --vs transformers --hf-budgets 8 --out "$out/bench_offload"
        run offload 120 python3 benchmarks/bench_offload_host.py ;;
    prefill-quant)
        run prefill-quant 420 python3 benchmarks/bench_quant_moe.py --tune --tune-types Q4_K_M --types Q4_K_M \
            --m 1 2 4 8 16 64 256 1024 2048 4096 --out "$out/quant_tune_prefill"
        run prefill-quant 240 python3 -m moerun.cli bench --preset qwen3-30b-a3b --quant Q4_K_M \
            --prefill-lens 512,2048,8192 --batch-sizes 1 --max-model-len 9216 --steps 16 --profile \
            --out "$out/bench_q4km_prefill" ;;
    variants)
        run variants 300 python3 benchmarks/bench_decode_variants.py --variant default \
            --variant qk:MOERUN_DECODE_QK_FUSED=1 --variant after_wait:MOERUN_PDL_TRIGGER=after_wait \
            --variant default_again
        run variants 300 python3 benchmarks/bench_decode_variants.py --quant Q4_K_M --variant default \
            --variant qk:MOERUN_DECODE_QK_FUSED=1 --variant after_wait:MOERUN_PDL_TRIGGER=after_wait \
            --variant separate:MOERUN_QUANT_JOINT=0 --variant default_again ;;
    pdl)
        for quant in "" "--quant Q4_K_M"; do
            for mode in "0 start" "1 start" "1 after_wait"; do
                set -- $mode
                run pdl 200 env MOERUN_PDL=$1 MOERUN_PDL_TRIGGER=$2 python3 -m moerun.cli bench --preset qwen3-30b-a3b \
                    $quant --prefill-lens 2048 --batch-sizes 1 --max-model-len 4096 --steps 32 --profile \
                    --out "$out/pdl_${1}_${2}${quant:+_q4km}"
            done
        done ;;
    quant)
        run quant 300 python3 benchmarks/tune_quant_gemv.py --preset qwen3-30b-a3b-q4_k_m --quick \
            --log-dir "$out/tune_logs"
        run quant 240 python3 benchmarks/bench_quant_moe.py --tune --tune-types Q4_K_M --types Q4_K_M \
            --m 1 2 4 8 --out "$out/quant_tune"
        run quant 240 python3 -m moerun.cli bench --preset qwen3-30b-a3b --quant Q4_K_M --prefill-lens 2048 \
            --batch-sizes 1 --max-model-len 4096 --steps 32 --profile --out "$out/bench_q4km" ;;
    pending)
        run pending 420 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_from_blocks.py \
            tests/kernels/test_route_fused.py tests/kernels/test_quant_moe.py tests/kernels/test_int8_dot.py \
            tests/kernels/test_quant_matmul.py tests/test_gguf_model.py -k "MXFP4 or IQ or int8 or grid or tile"
        run pending 420 python3 benchmarks/bench_quant_moe.py --types IQ2_XXS IQ3_S MXFP4 Q4_K --m 1 8 64 1024 2048 \
            --out "$out/quant_pending"
        run pending 240 env MOERUN_GRID_TILES=0 python3 benchmarks/bench_quant_moe.py --types IQ2_XXS IQ3_S \
            --m 64 1024 2048 --out "$out/quant_pending_grid_off"
        run pending 240 python3 -m moerun.cli bench --preset qwen3-30b-a3b --quant Q4_K_M --prefill-lens 128 \
            --batch-sizes 1 --max-model-len 4096 --steps 32 --profile --out "$out/pending_q4km"
        for quant in IQ2_M MXFP4_MOE; do
            run pending 300 python3 -m moerun.cli bench --preset qwen3-30b-a3b --quant $quant \
                --prefill-lens 512,2048 --batch-sizes 1,8 --max-model-len 4096 --steps 16 --out "$out/pending_$quant"
        done
        run pending 240 env MOERUN_GRID_TILES=0 python3 -m moerun.cli bench --preset qwen3-30b-a3b --quant IQ2_M \
            --prefill-lens 512,2048 --batch-sizes 1 --max-model-len 4096 --steps 8 --out "$out/pending_IQ2_M_off" ;;
    gguf-offload)
        run gguf-offload 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_moe_indirect.py \
            tests/offload/test_zero_copy.py tests/offload/test_offload_generation.py tests/offload/test_packed_pool.py
        run gguf-offload 300 python3 benchmarks/bench_offload.py --only-gguf --gguf-modes copy,zero_copy --steps 16 \
            --out "$out/bench_offload_gguf" ;;
    *)
        echo "unknown stage $stage" >&2 ;;
    esac
done
