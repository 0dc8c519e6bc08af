#!/usr/bin/env bash
# The H200 measurements the CPU-side kernels of benchmarks/NOTES.md are waiting for, in priority order.
#
#   bash benchmarks/h200_pending.sh [STAGE ...]        (default: every stage, in this order)
#   STAGE: decode bf16_tests step_rows tests tests_rest prefill prefill_chunks attention gemv moe_stream moe_prefill moe_fold moe_scaled moe_scaled_tests indexer
#          block_select indexer_tests v4_indexer v4_attention v4_cut dense_b32 attn_b32 b1_gaps linear_prefill
#
# From a cold tuning store the first stage spends most of its time in the tuners' first calls (on an H100, 2026-12-06:
# `decode` did not finish in 330 s cold and took 83 s warm), so give a cold store's first call 540 s for `decode`
# alone, or point REDKNOT_TUNING_CACHE at a store that survives between calls on the same machine.
#
# Each stage runs under its own time limit and logs to $OUT/<stage>.log (default
# OUT=outputs/h200/<UTC date-time>); the kernel tuning store is $REDKNOT_TUNING_CACHE (default
# $OUT/tune/kernel_choices.json, so an earlier stage's choices serve the later ones) and is exported at the end
# as a seed file ($OUT/seed.json: commit it as redknot/kernels/tuned/h200.json when the GPU and versions are the
# shipped ones). TOTAL_S (default 3000) bounds the whole run: a stage that cannot get at least 60 s is skipped.
# DECODE_BATCHES (default 1,32,128) narrows the `decode` stage; PREFILL_CHUNKS_S (default 450) is the `prefill_chunks`
# stage's limit, for a call that runs it alone; V4_CUT_SKIP (default tiny,truth,parity) is the `v4_cut` stage's
# --skip list and V4_CUT_ARGS more of its arguments (decode alone: V4_CUT_ARGS=--prefill, the decode contexts'
# own prefills only; prefill alone: V4_CUT_SKIP=tiny,truth,parity,decode).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-outputs/h200/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 REDKNOT_TUNING_CACHE=${REDKNOT_TUNING_CACHE:-$OUT/tune/kernel_choices.json}
mkdir -p "$(dirname "$REDKNOT_TUNING_CACHE")"
TOTAL_S=${TOTAL_S:-3000}
t0=$(date +%s)
# PIN_FROM=H100: a GPU the shipped seeds have few classes for starts from another GPU's shipped choices, pinned
# (untimed) under this machine's environment; this GPU's own shipped choices and the store still win. The tuners then
# time nothing the sibling measured: say so next to any number from such a run.
if [ -n "${PIN_FROM:-}" ]; then
  seeds=$OUT/seed_pinned; mkdir -p "$seeds"
  here=$(python3 -c "import torch; from redknot.kernels import tuning_cache as t; print(t.environment(torch.device('cuda')))")
  for f in redknot/kernels/tuned/*.json; do
    python3 -m redknot.kernels.tuning_cache export "$f" "$seeds/0_pinned_$(basename "$f")" --gpu "$PIN_FROM" \
      --pin-as "$here" > /dev/null 2>&1 && echo "pinned $PIN_FROM choices of $f under '$here'"
    cp "$f" "$seeds/"
  done
  export REDKNOT_TUNING_SEED=$seeds
fi
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(decode tests prefill prefill_chunks moe_unroll moe_gemv step_gemv b1_gaps dense_b32 attn_b32 select_b1 rope attention gemv moe_stream
                                    moe_prefill moe_fold moe_scaled moe_scaled_tests linear_prefill indexer block_select indexer_tests v4_indexer v4_attention v4_cut)

GPU_TESTS_FIRST=(tests/kernels/test_slice_sum_gpu.py tests/kernels/test_step_b1_gpu.py tests/kernels/test_step_proj_v41_gpu.py
  tests/kernels/test_step_proj_gemv_v41_gpu.py
  tests/unit/model/v41_forward/test_v41_tensor_step_kernels.py tests/kernels/test_step_moe_v41_gpu.py
  tests/kernels/test_step_rows_v41_gpu.py tests/kernels/test_moe_stream_gpu.py tests/kernels/test_gemv_mx_gpu.py
  tests/unit/kernels/test_v41_attention_prefill.py)
# the rest of the list (run 6's `tests` stage passed the first part, 269 tests in 423 s, and stopped here)
GPU_TESTS_REST=(tests/unit/kernels/test_v4_attention_prefill.py
  tests/unit/kernels/test_prefill_rows_v41.py tests/unit/model/v41_forward/test_v41_prefill_rows.py
  tests/kernels/test_moe_prefill_fp8_gpu.py tests/unit/kernels/test_tuner_graph_timing.py tests/unit/kernels/test_graph_capture.py
  tests/unit/kernels/test_v4_indexer_stream.py tests/unit/kernels/test_radix_select.py
  tests/unit/kernels/test_linear_prefill_mx.py tests/unit/kernels/test_prefill_hash_v41.py
  tests/unit/kernels/test_step_attention_two_loads.py tests/unit/kernels/test_step_index_loop.py
  tests/unit/model/v41_forward/test_v41_side_stream.py tests/unit/kernels/test_gemv_bf16.py
  tests/unit/kernels/test_compress_v4.py)
# (tests/unit/kernels/test_v41_indexer_stream.py is the `indexer_tests` stage: with it this list did not finish in
# 557 s on an H100, 2026-12-07)
GPU_TESTS=("${GPU_TESTS_FIRST[@]}" "${GPU_TESTS_REST[@]}" tests/unit/kernels/test_v41_indexer_stream.py)

stage() {  # name, limit seconds, command... (a --budget-s B in the command becomes the limit less 20 s)
  local name=$1 limit=$2; shift 2
  local left=$(( TOTAL_S - ($(date +%s) - t0) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 60 ]; then echo "$name: skipped ($left s left of TOTAL_S)"; return; fi
  local args=() a
  for a in "$@"; do [ "$a" = B ] && a=$(( limit - 20 )); args+=("$a"); done
  local t1 rc
  t1=$(date +%s)
  timeout "$limit" "${args[@]}" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc after $(( $(date +%s) - t1 )) s (limit $limit s; $(( $(date +%s) - t0 )) s since the start; log $OUT/$name.log)"
}

for s in "${STAGES[@]}"; do
  case $s in
    decode)  # V4.1 decode in CUDA graphs on a synthetic state, per-kernel step profile
      stage decode 540 python3 benchmarks/e2e_v41.py --out "$OUT/decode" --prefill '' --decode-context 8192 \
        --decode-batch ${DECODE_BATCHES:-1,32,128} --decode-synthetic --decode-graphs --skip-parity --profile-steps 5 --side-stream-tokens ${SIDE_TOKENS:-128} --budget-s B \
        --log-level INFO ;;
    bf16_tests)  # V4's decode launches on the GPU, every test of their files (not only the -m gpu ones: the others run
      # on the GPU too there): the bf16 GEMV streams at 1-4 rows and the router's affinities, the compressor's pooling
      # and decode update, the routing, the indexer's token tiles, the mHC site with its norm, the step's indices, the
      # attention's decode shapes, the projection groups, the step tables, the shared expert in the routed launches,
      # the indexer's merge tree, the in-place inverse rotation, the shared expert's rows in the routed combine, the
      # router's affinities as one GEMM past the GEMV rows
      stage bf16_tests 300 python3 -m pytest -n 0 -m 'not slow' -v -rfE -p no:cacheprovider tests/unit/kernels/test_gemv_bf16.py \
        tests/unit/kernels/test_compress_v4.py tests/unit/kernels/test_route_v4.py tests/unit/kernels/test_token_tiles.py \
        tests/unit/kernels/test_mhc_pre_norm_v4.py tests/unit/kernels/test_kernel_helpers.py \
        tests/unit/kernels/test_indexer_merge.py tests/unit/kernels/test_norm_rope.py \
        tests/unit/kernels/test_v4_attention_decode.py tests/unit/model/test_v4_linear_group.py \
        tests/unit/kernels/test_step_tables.py tests/unit/kernels/test_moe_shared.py tests/unit/kernels/test_router_mm.py ;;
    side_tests)  # the side stream's GPU tests (a graph of two streams; the toy cut's step on two streams, same bits)
      stage side_tests 420 python3 -m pytest -n 0 -m gpu -v -rfE -p no:cacheprovider tests/unit/model/v41_forward/test_v41_side_stream.py \
        tests/unit/model/v41_forward/test_v41_tensor_step.py::test_gpu_engine_decodes_tiny_v41_in_cuda_graphs ;;
    step_rows)  # b32 decode with the step's fused projection / MoE launches up to 32 rows (default 16): the `decode`
      # stage's b32 row is the comparison (DECODE_BATCHES=32 in the same call; H100 run 10: 6.88 against 6.72 ms)
      stage step_rows 200 python3 benchmarks/e2e_v41.py --out "$OUT/step_rows" --prefill '' --decode-context 8192 \
        --decode-batch 32 --decode-synthetic --decode-graphs --skip-parity --profile-steps 5 --step-rows 32 \
        --budget-s B ;;
    tests)
      stage tests 580 python3 -m pytest -n 0 -m gpu -v -rfE -p no:cacheprovider --durations=15 "${GPU_TESTS[@]}" ;;
    tests_rest)  # the part of the list the `tests` stage has not reached in one call
      stage tests_rest 580 python3 -m pytest -n 0 -m gpu -v -rfE -p no:cacheprovider --durations=15 "${GPU_TESTS_REST[@]}" ;;
    prefill)  # V4.1 prefill 8K / 32K: per-op shares and the prefill row fusions off / on
      stage prefill 300 python3 benchmarks/e2e_v41.py --out "$OUT/prefill" --prefill 8192,32768 --decode-context '' \
        --decode-batch '' --skip-parity --budget-s B --log-level INFO ;;
    prefill_chunks)  # V4.1 prefill in 32K-token chunks to 1M (the MoE expansion, a fixed cost a chunk, over 4x the
      # tokens of 8K chunks; the candidate source's block selection at 1M); a case the budget cannot reach is skipped
      stage prefill_chunks ${PREFILL_CHUNKS_S:-450} python3 benchmarks/e2e_v41.py --out "$OUT/prefill_chunks" --prefill 32768,131072,1048576 \
        --chunk 32768 --decode-context '' --decode-batch '' --skip-parity --budget-s B --log-level INFO ;;
    moe_unroll)  # b32 / b128 routed-expert stream: fp8hd4 with 128 / 256 / 512 bytes of each weight row per stage
      stage moe_unroll 220 python3 benchmarks/kernels_v41.py --only stream --stream-variants moe_unroll \
        --out "$OUT/moe_unroll" --budget-s B ;;
    moe_gemv)  # b1 routed experts: the direct-load and fused MoE GEMV plans against the current choice
      stage moe_gemv 180 python3 benchmarks/kernels_v41.py --only stream --stream-variants moe_gemv \
        --out "$OUT/moe_gemv" --budget-s B ;;
    step_gemv)  # b1 step GEMV launches (wq_a|wkv, wq_b + indexer, wo_b, Engram wkv): today's plans, _flat, _wave
      stage step_gemv 200 python3 benchmarks/kernels_v41.py --only stream --stream-variants step_gemv \
        --out "$OUT/step_gemv" --budget-s B ;;
    b1_gaps)  # b1 step: wo_a GEMVs on the stored FP8, router logits, mHC site forms vs the launches they replace
      stage b1_gaps 150 python3 benchmarks/step_kernels_v41.py --b1-gaps --out "$OUT/b1_gaps" ;;
    dense_b32)  # b32 / b128 step outside the routed stream: the dense FP8 linears by decode (slice sum in the launch,
      # fewer slices, 64-row tiles) and wo_a's FP8 streams vs the einsum
      stage dense_b32 150 python3 benchmarks/dense_step_v41.py --only linear --out "$OUT/dense_b32" --rows 32 128 \
        --budget-s B ;;
    attn_b32)  # b32 / b128 step attention and indexer-score launch shapes (each a compile at V4.1 width)
      stage attn_b32 200 python3 benchmarks/dense_step_v41.py --only attention --out "$OUT/attn_b32" --rows 32 128 \
        --budget-s B ;;
    select_b1)  # the b1 step's four top-k selections under every radix_select candidate (counting forms)
      stage select_b1 120 python3 benchmarks/select_topk_v41.py --b1 --out "$OUT/select_b1" ;;
    rope)  # prefill RoPE of the rotated columns in place: contiguous rows against the stride-2 form and rope_rows
      stage rope 60 python3 benchmarks/rope_cols_v41.py --out "$OUT/rope" ;;
    attention)  # V4.1 sparse attention prefill: the transposed-score shapes next to the earlier ones
      stage attention 120 python3 benchmarks/kernels_v41.py --only attention --contexts 8192 --out "$OUT/attention" \
        --budget-s B ;;
    gemv)  # weight streams at 1-4 rows: GEMV candidates next to the tensor-core streams
      stage gemv 200 python3 benchmarks/kernels_v41.py --only stream --stream-variants gemv --out "$OUT/gemv" \
        --budget-s B ;;
    moe_stream)  # MoE decode stream variants (halves order, block-diagonal tiles)
      stage moe_stream 240 python3 benchmarks/kernels_v41.py --only stream --stream-variants moe --out "$OUT/moe_stream" \
        --budget-s B ;;
    moe_prefill)  # MoE prefill on FP8 tensor cores against the grouped plan
      stage moe_prefill 330 python3 benchmarks/kernels_v41.py --only prefill --out "$OUT/moe_prefill" --budget-s B ;;
    moe_fold)  # MoE prefill with the weight scale folded into the FP4 decode, next to the halves order
      stage moe_fold 200 python3 benchmarks/kernels_v41.py --only prefill --prefill-decodes fp8ht,fp8f \
        --out "$OUT/moe_fold" --budget-s B ;;
    moe_scaled)  # MoE prefill through e4m3 experts + torch._scaled_grouped_mm (moe_prefill_scaled) at 8K / 32K tokens:
      # each plan whole (err vs ref_v41, inexact weight columns) and the one-chunk plan by part, next to the grouped plan
      stage moe_scaled 200 python3 benchmarks/kernels_v41.py --only prefill --prefill-decodes scaled --reps 10 \
        --out "$OUT/moe_scaled" --budget-s B ;;
    linear_prefill)  # linear_mx above 128 rows: dequant + bf16 GEMM against fp8_rowwise (torch._scaled_mm), grouped wo_a
      stage linear_prefill 150 python3 benchmarks/linear_prefill_v41.py --out "$OUT/linear_prefill" ;;
    moe_scaled_tests)  # its GPU tests at V4.1 shapes (the library GEMM, the expansion, every plan against ref_v41)
      stage moe_scaled_tests 240 python3 -m pytest -n 0 -m gpu -v -rfE -p no:cacheprovider \
        tests/kernels/test_moe_prefill_scaled_gpu.py ;;
    v4_indexer)  # V4 indexer prefill: the gathered-key pipelined stream next to the paged kernel
      stage v4_indexer 180 python3 benchmarks/kernels_v4.py --skip-checks --only indexer_topk --contexts 32768 450560 \
        --budget-s B --out "$OUT/v4_indexer" ;;
    block_select)  # the candidate source's block selection from its block maxima: radix select against torch.topk
      stage block_select 120 python3 benchmarks/indexer_v41_prefill.py --select-only --entries 32768,131072,262144 \
        --budget-s B --out "$OUT/block_select" ;;
    indexer_tests)  # every expanded stream shape at V4.1 widths on the GPU (cut by counting, max_regs) against the register stream
      stage indexer_tests 300 python3 -m pytest -n 0 -m gpu -v -rfE -p no:cacheprovider tests/unit/kernels/test_v41_indexer_stream.py ;;
    indexer)  # indexer prefill stream with expanded keys (IXDECODES=expanded: only those shapes)
      stage indexer 240 python3 benchmarks/indexer_v41_prefill.py --stream-only ${IXDECODES:+--decodes $IXDECODES} \
        --out "$OUT/indexer" --budget-s B ;;
    v4_attention)  # V4 sparse attention prefill: transposed-score candidate (separate store: its classes re-tune)
      stage v4_attention 160 python3 benchmarks/kernels_v4.py --skip-checks --only sparse_attention --contexts 8192 131072 \
        --budget-s B --out "$OUT/v4_attention" ;;
    v4_cut)  # the V4 real-dimension cut, prefill and decode (before/after against benchmarks/NOTES.md)
      stage v4_cut 600 python3 benchmarks/e2e_cut.py --out "$OUT/v4_cut" --skip ${V4_CUT_SKIP:-tiny,truth,parity} ${V4_CUT_ARGS:-} --budget-s B ;;
    *) echo "unknown stage '$s'; stages: decode bf16_tests side_tests step_rows tests tests_rest prefill prefill_chunks moe_unroll moe_gemv step_gemv b1_gaps dense_b32 attn_b32 select_b1 rope attention gemv moe_stream moe_prefill moe_fold moe_scaled moe_scaled_tests indexer block_select indexer_tests"\
         "v4_indexer v4_attention v4_cut"
       exit 2 ;;
  esac
done
python3 -m redknot.kernels.tuning_cache export "$REDKNOT_TUNING_CACHE" "$OUT/seed.json" > "$OUT/seed.log" 2>&1 \
  && echo "seed: $OUT/seed.json"
