#!/usr/bin/env bash
# The GPU node's figures in one go (benchmarks/README.md, On a GPU node): the pipeline's ceiling with a null env on
# this node's cores, then real NLE with the policy on the GPU at two sizes, ranking with an instant stub LLM beside
# `none`. Each part is cut at its time limit so that the others still run.
#     bash benchmarks/gpu_node.sh [WORKERS] [OUTDIR]      # WORKERS: default nproc - 2 (a core for acting, one for learning)
set -uo pipefail
cd "$(dirname "$0")/.."
workers=${1:-$(( $(nproc) - 2 ))}
out=${2:-.}
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null; echo "$(nproc) cores, $workers env workers"
timeout 120 python3 benchmarks/pipeline_ceiling.py --threads 1 --num-workers "$workers" --num-envs-per-worker 16 64 \
    --batch-size 1024 4096 --seconds 5 2>&1 | tee "$out/ceiling.log"
timeout 180 python3 benchmarks/throughput.py --num-workers "$workers" --num-envs-per-worker 16 --batch-size 1024 \
    --steps 400000 --raw-seconds 5 --llm stub \
    2>&1 | tee "$out/throughput_16envs.log"
timeout 100 python3 benchmarks/throughput.py --num-workers "$workers" --num-envs-per-worker 64 --batch-size 4096 \
    --steps 800000 --raw-seconds 2 2>&1 | tee "$out/throughput_64envs.log"
