#!/bin/bash
# Session 6, run 2: where MLA's forward time goes (benchmarks/probes/mla_parts.py), then the
# harness's MLA rows with the fold's columns as one slice (bd8826a).
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
timeout 200 python3 benchmarks/probes/mla_parts.py 2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
echo "== bench at $(( $(date +%s)-T0 )) s"
timeout 150 python3 benchmarks/run.py --max-seconds 140 --seqs 4096 --head-dims 128 --long 0 --mods mla_rope --impls scoremod,jax-cudnn,jax-cudnn-mla --directions fwd,fwdbwd --reps 9 --json $OUT/mla.json 2>&1 | grep -E "^\[|rror"
echo "== done at $(( $(date +%s)-T0 )) s"
