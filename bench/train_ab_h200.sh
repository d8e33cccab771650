#!/bin/bash
# The one-lease A/B of run L (bench/results/train_h200.txt): build/ab/{before,nofused} were
# copies of sglang_dsv41, trainer_bridge and bench at the compared commits (git archive; B with
# norm.py and moe.py's CUDA branches off). One H200 lease: GPU tests of the new kernels, a
# same-host A/B of the trainer step, the 64k memory plan, micro-batches, and a two-GPU profile.
# Run from the repo root.
set -o pipefail
T=bench/train.py
S="--preset small --steps 5 --warmup 2 --no-twin"
log() { echo "=== $1 ($(date +%T))"; }
log tests
timeout 120 python -m pytest -q -x tests/test_dsv4_norm_triton.py tests/test_dsv4_swiglu_triton.py tests/test_dsv4_mhc_streams_triton.py tests/test_dsv4_hc_weights_triton.py tests/test_engine_attention_dispatch.py 2>&1 | tail -4
log "A before (c88c1e5)"
(cd build/ab/before && timeout 90 python $T $S --seqs 4096 --transformers none 2>&1 | tee $OUT/A_before.txt | grep -E "^ours .*4096 ")
log "B head"
timeout 110 python $T $S --seqs 4096 --transformers grouped_mm 2>&1 | tee $OUT/B_head.txt | grep -E "^ours .*4096 |^transformers|^speed-up"
log "C head, torch RMSNorm and SwiGLU"
(cd build/ab/nofused && timeout 90 python $T $S --seqs 4096 --transformers none 2>&1 | tee $OUT/C_nofused.txt | grep -E "^ours .*4096 ")
log "B head, 4 micro-batches"
timeout 110 python $T --preset small --steps 3 --warmup 1 --no-twin --seqs 4096 --micro-batches 4 --transformers grouped_mm 2>&1 | tee $OUT/B_micro4.txt | grep -E "^ours .*4096 |^transformers|^speed-up"
log "64k plan, one GPU"
timeout 100 python $T --preset small --steps 1 --warmup 1 --no-twin --seqs 65536 --checkpointing layer --transformers none 2>&1 | tee $OUT/plan_64k.txt | grep -E "^ours .*65536 |planned peak|backward's rise|at the peak"
log "two GPUs, 4k, profile"
timeout 150 torchrun --nproc-per-node 2 $T --preset small --steps 3 --warmup 2 --no-twin --seqs 4096 --profile-seq 4096 --transformers none 2>&1 | tee $OUT/twogpu_profile.txt | grep -E "^ours .*4096 |per step:|phases per step|host syncs in one step"
log done
