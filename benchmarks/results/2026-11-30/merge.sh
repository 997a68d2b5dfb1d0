#!/usr/bin/env bash
# Rebuilds docs/images/bench.json, docs/performance.md and docs/images/bench.png
# from the runs of 2026-11-30, in run order (a later file wins for the same case).
# Left out on purpose: split4k_c7f59bb.json, split16k_c7f59bb.json (the reverted
# key-split backward), splitq4k_c7f59bb.json (repeated by split4k_a21f83b.json),
# the fixed-block-count probes split4/8_fwd_3348154.json and the batch-1 run
# split_b1h8_e4507c5.json (another batch and head count).
set -eu
R=$(dirname "$0")
cd "$R/../../.."
R=benchmarks/results/2026-11-30
python benchmarks/run.py --doc docs/performance.md --json docs/images/bench.json --from \
    $R/s4096_d128.json $R/flex_s4096_d128.json $R/native_s4096.json $R/s16384.json \
    $R/s32768.json $R/lowerings.json $R/split_e4507c5.json $R/softcap_direct.json \
    $R/s1024.json $R/s4096_d64.json $R/bias_long.json $R/flex_s16384.json \
    $R/s16384_rest_7750786.json $R/s16384_d64_7750786.json $R/s1024_split_7750786.json \
    $R/loads_direct_c09c8f8.json $R/split_c09c8f8.json $R/s1024_doc_jax_c09c8f8.json \
    $R/flex_s16384_masks_f239405.json $R/split_1de3b33.json $R/relbias16k_1de3b33.json \
    $R/xla16k_1de3b33.json $R/doc_xla1024_1de3b33.json $R/flex1024_1de3b33.json \
    $R/flex_d64_1de3b33.json $R/relbias_direct_c7f59bb.json $R/split4k_a21f83b.json
