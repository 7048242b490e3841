#!/usr/bin/env bash
# One device call that validates HEAD on the GPU and times it (logs under $OUT, summary last).
#   bash .gpu_wheels/install.sh && export PYTHONPATH=/tmp/site:$PWD/src && bash scripts/gpu_validation.sh [parts]
# parts (default: tests draft batched moe): tests, hgemv, draft, batched, batched32, moe, moesweep, stream, linear, ncu,
# hmma, staged, probe, stages2, occ, ncu16, optests, tickets, rounding, attn, lmhead, quick, hc.
# On nvidia-h200-x2 the two-GPU tests and the split-target benchmark run too; on one GPU they
# skip / use that GPU.  batched32: the fp32 target (equality checks immune to bf16 near-ties),
# both target attentions; moesweep: FP4-MoE variants and the read probe (bytes alone); linear: the skinny-linear
# op vs cuBLAS with a read-only L2 flush; ncu: Nsight Compute on the T=1 FP4 MoE kernels (pipes, stalls);
# staged: the staged fp16-MMA loop (fp4_moe_hmma prefetch 0) tested and swept against the defaults and the
# previous routing (pre9), T=1..16: register caps, grid order (tiles_first), 4 stages; probe: the staged loop's loads
# alone against a contiguous read; stages2: 2 stages at lower register caps; occ: down to 48 registers;
# optests: the op's GPU tests (test_fp4_moe_op, test_mtp_moe, test_fp4_moe_stream); tickets: the token sums and the
# router's top-k in their kernels (ticket tests, and the op against the separate sum kernel, sumk).
set -u
OUT=${OUT:-/tmp/gpu_validation}
mkdir -p "$OUT" "$OUT/fp32" "$OUT/sweep" "$OUT/probe" "$OUT/stages2_mx" "$OUT/stages2_nv" "$OUT/occ_mx" "$OUT/occ_nv"
parts=${*:-tests draft batched moe}
summary=()
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-8s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-110)")")
}
nvidia-smi -L | tee "$OUT/gpus.txt"
for part in $parts; do
  case $part in
    # the whole GPU suite (376 tests) takes more than one 10-minute device call: tests = all but the two
    # FP4-MoE kernel-variant files (~6 min), hmma and hgemv = those (~8 min together)
    tests)   run tests python3 -m pytest tests -q -m gpu -p no:cacheprovider --durations=15 \
               --ignore=tests/test_fp4_moe_hmma.py --ignore=tests/test_fp4_moe_hgemv.py ;;
    hgemv)   run hgemv_tests python3 -m pytest tests/test_fp4_moe_hgemv.py -m gpu -q -p no:cacheprovider ;;
    draft)   run draft python3 benchmarks/draft_step.py --iters 30 --out "$OUT" ;;
    batched) run batched python3 benchmarks/batched_generate.py --out "$OUT" ;;
    moe)     run moe python3 benchmarks/moe_op.py --out "$OUT" --iters 20 --flush rotate ;;
    batched32) run batched32 python3 benchmarks/batched_generate.py --dtype float32 --layers 2 --no-demo --repeats 1 --out "$OUT/fp32" ;;
    moesweep) run moesweep python3 benchmarks/moe_op.py --fmts nvfp4 --ts 1,2,4 --ref-ts "" --no-humming --read-probe 4096 --sweep gv32@1+2,gvrow@1,dot --out "$OUT/sweep" ;;
    stream)  run stream_tests python3 -m pytest tests/test_fp4_moe_stream.py -m gpu -q -p no:cacheprovider
             run stream python3 benchmarks/moe_op.py --fmts nvfp4,mxfp4 --sweep-fmts nvfp4 --ts 1,2,4,16 --ref-ts "" \
               --flush rotate --iters 30 --read-probe 4096 --sweep gv_t2,st_probe@1,st_gu@1,st_dn@1,st_tma,hg32@1,hm@1 --out "$OUT/sweep" ;;
    linear)  run linear python3 benchmarks/linear_op.py --flush read --out "$OUT" ;;
    hmma)    run hmma_subnormal python3 -m pytest tests/test_fp4_moe_hmma.py -m gpu -q -k subnormal -p no:cacheprovider
             run hmma_tests python3 -m pytest tests/test_fp4_moe_hmma.py -m gpu -q -p no:cacheprovider
             run hmmasweep python3 benchmarks/moe_op.py --fmts nvfp4,mxfp4 --sweep-fmts nvfp4,mxfp4 --ts 1,2,4,8,16 --ref-ts "" \
               --no-humming --iters 30 --sweep hm,hm_pf2,hm_n1,hm_n4,hg32,dot --out "$OUT/sweep" ;;
    staged)  run staged_tests python3 -m pytest tests/test_fp4_moe_hmma.py -m gpu -q -k "staged or variants" -p no:cacheprovider
             run staged python3 benchmarks/moe_op.py --fmts nvfp4,mxfp4 --sweep-fmts nvfp4,mxfp4 --ts 1,2,3,4,8,16 --ref-ts "" \
               --no-humming --flush rotate --iters 20 --out "$OUT/sweep" \
               --sweep pre9,hm_st@3+8+16,hm_st_r128@8+16,hm_st_tf@8+16,hm_st_r128_tf@8+16,hm_st_n2_r96_tf@4+8+16,hm_st_n2_r96s4@4+8+16 ;;
    # probe: what the staged loop's loads alone cost (its grid and ring, no math), against the contiguous read probe
    probe)   run probe python3 benchmarks/moe_op.py --fmts nvfp4,mxfp4 --sweep-fmts nvfp4,mxfp4 --ts 4,8,16 --ref-ts "" \
               --no-humming --flush rotate --iters 20 --read-probe 4096,16384 --out "$OUT/probe" \
               --sweep hm_st_pr,hm_st_tf_pr,hm_st_n2_r96_pr,hm_st_n2_r96_tf_pr,st_probe ;;
    # stages2: the staged loop with 2 stages (one buffer) and lower register caps: more programs per SM
    stages2) run stages2_mx python3 benchmarks/moe_op.py --fmts mxfp4 --sweep-fmts mxfp4 --ts 3,4,8,16 --ref-ts "" \
               --no-humming --flush rotate --iters 20 --out "$OUT/stages2_mx" --sweep hm_st2_r128,hm_st2_r96,hm_st2_r80,hm_st2_r72
             run stages2_nv python3 benchmarks/moe_op.py --fmts nvfp4 --sweep-fmts nvfp4 --ts 4,8,16 --ref-ts "" \
               --no-humming --flush rotate --iters 20 --out "$OUT/stages2_nv" --sweep hm_st2_n2_r80 ;;
    # occ: more programs per SM than the routing's (2 stages; register caps 72..48; MXFP4 with one B copy per
    # program, "share", for a 22 KB buffer), and the loads alone (_pr) of the routed forms and of the denser ones
    occ)     run occ_mx python3 benchmarks/moe_op.py --fmts mxfp4 --sweep-fmts mxfp4 --ts 3,4,8,16 --ref-ts "" \
               --no-humming --flush rotate --iters 20 --out "$OUT/occ_mx" \
               --sweep hm_st2_sx_r72,hm_st2_sx_r64,hm_st2_sx_r56,hm_st2_sx_r48,hm_st2_r72_pr@8+16,hm_st2_sx_r56_pr@8+16
             run occ_nv python3 benchmarks/moe_op.py --fmts nvfp4 --sweep-fmts nvfp4 --ts 4,8,16 --ref-ts "" \
               --no-humming --flush rotate --iters 20 --out "$OUT/occ_nv" \
               --sweep hm_st2_n2_r72,hm_st2_n2_r64,hm_st2_n2_r56,hm_st2_n2_r48,hm_st_n2_r96_pr@8+16,hm_st2_n2_r56_pr@8+16 ;;
    # ncu16: Nsight Compute on the routed staged kernels at T=16 (both formats): occupancy, DRAM, pipes, stall reasons,
    #        at the boost clock (without --clock-control none ncu locks the SMs at 1.33 GHz)
    ncu16)   for f in mxfp4 nvfp4; do run ncu16_$f ncu --clock-control none --kernel-name regex:hmma --section SpeedOfLight \
               --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \
               --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active" \
               python3 benchmarks/moe_ncu.py --t 16 --fmt $f --variants ""; done ;;
    tickets) run ticket_tests python3 -m pytest tests/test_fp4_moe_stream.py tests/test_moe_route.py -m gpu -q -p no:cacheprovider
             run tickets python3 benchmarks/moe_op.py --fmts nvfp4,mxfp4 --sweep-fmts nvfp4,mxfp4 --ts 1,2,4,16 --ref-ts "" \
               --no-humming --iters 20 --flush rotate --sweep sumk --out "$OUT/sweep" ;;
    optests) run optests python3 -m pytest tests/test_fp4_moe_op.py tests/test_mtp_moe.py tests/test_fp4_moe_stream.py -m gpu -q -p no:cacheprovider ;;
    rounding) run rounding python3 benchmarks/rounding_stages.py --device cuda --batch 64 ;;
    attn)    run attn python3 benchmarks/attention_op.py --out "$OUT" ;;
    quick)   run quick python3 benchmarks/draft_step.py --quick --iters 20 --out "$OUT" ;;
    hc)      run hc python3 benchmarks/hc_op.py --out "$OUT" ;;
    lmhead)  run lmhead python3 benchmarks/linear_op.py --lm-head --rows 1,4,16 --iters 30 --out "$OUT" ;;
    ncu)     run ncu ncu --profile-from-start off --clock-control none --section SpeedOfLight --section SchedulerStats \
               --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats --section LaunchStats \
               python3 benchmarks/moe_ncu.py --t 1 --variants gv32,mma ;;
    *) echo "unknown part $part (tests, hgemv, draft, batched, batched32, moe, moesweep, stream, linear, ncu, hmma, staged, probe, stages2, occ, ncu16, optests, tickets, rounding, attn, lmhead, quick, hc)"; exit 2 ;;
  esac
done
for name in draft quick tickets rounding batched batched32 moe moesweep stream hmmasweep staged probe stages2_mx stages2_nv occ_mx occ_nv ncu16_mxfp4 ncu16_nvfp4 attn hc lmhead linear ncu; do  # each benchmark's own table
  [ -f "$OUT/$name.log" ] && { echo "== $name"; tail -n 16 "$OUT/$name.log"; }
done
echo "== summary"
printf '%s\n' "${summary[@]}"
