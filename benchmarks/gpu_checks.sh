#!/usr/bin/env bash
# The GPU checks in one go, on a machine with one CUDA GPU; each writes its output to $OUT.
#   OUT=/tmp/gpu bash benchmarks/gpu_checks.sh
set -u
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
run() {  # name, seconds, command...: one check, its output in $OUT/name.txt, a line saying how it ended
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# [4/9]: each schedule on one rank (CUDA, NCCL, world size 1) against the unsplit model, and its peak memory.
run gpu_check_tiny 150 "$PY" benchmarks/gpu_check.py
run gpu_check_small 200 "$PY" benchmarks/gpu_check.py --preset gpt-small --seq-len 1024 --batch 10 --microbatches 4
# [7/9]: the planner's profile on the GPU against a training run of the same single stage.
run plan_fidelity 240 "$PY" benchmarks/plan_fidelity.py --device cuda --presets gpt-tiny,gpt-small
# Hugging Face models as they are: GPT-2, Llama and BERT on meta, each schedule on one rank against the unsplit model.
run hf_gpu_check 240 "$PY" benchmarks/hf_gpu_check.py --steps 3 --layers 4
# Sharding inside stages on one GPU: FSDP's bf16 policy on a single-rank mesh against fp32 and bf16 autocast.
run shard_gpu_check 300 "$PY" benchmarks/shard_gpu_check.py --preset gpt-small --seq-len 1024 --batch 8 --steps 6
# Compiled and eager, fp32 and bf16 on one GPU: MFU, the executor's overhead against the bare loop, memory against
# the plan; dropout resumed exactly from a checkpoint (the CUDA generator's state).
run mfu_gpu_check 420 "$PY" benchmarks/mfu_gpu_check.py --presets gpt-small,gpt-medium --batch 8 --microbatches 4
# Memory options on one GPU: checkpointing (whole, selective; under 1F1B, zero-bubble and ZBV), activation offload
# and FSDP's per-micro-batch gathering and optimizer offload, each against the unsplit model, with its memory and time.
run memory_gpu_check 300 "$PY" benchmarks/memory_gpu_check.py --preset gpt-small --seq-len 1024 --batch 8 --microbatches 4
# The mixture-of-experts GPT on one GPU against the unsplit model (1F1B, DualPipeV); with 4 GPUs, expert parallelism
# (pp2 x dp2, ep=2) under DualPipeV with its forward and backward pairs overlapped and not, on NCCL.
run moe_gpu_check 240 "$PY" benchmarks/moe_gpu_check.py
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 4 ]; then
    run moe_overlap 300 "$PY" benchmarks/moe_overlap.py --steps 8 --batch 64 --seq-len 256
fi
# A local Hugging Face folder trained from the command line on one GPU.
"$PY" -c 'import transformers as t; t.GPT2LMHeadModel(t.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=256, n_positions=256)).save_pretrained("/tmp/stagewise-hf-gpt2")' > /dev/null 2>&1
run train_hf 150 "$PY" -m stagewise train --model hf:/tmp/stagewise-hf-gpt2 --pp 1 --steps 30 --seq-len 128 --out /tmp/stagewise-gpu-hf-run
# The main job on one GPU.
run train 150 "$PY" -m stagewise train --pp 1 --steps 30 --eval-every 10 --out /tmp/stagewise-gpu-run
cp /tmp/stagewise-gpu-run/summary.json "$OUT/train_summary.json"
tail -n 4 "$OUT"/*.txt
