#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, as one device run of at most about seven minutes (a
# session's device time is short; the default stages' timeouts add up to 580 s, and real-size
# and tests took 100 and 140 s on an H200), the real-size figures first (the benchmark prints
# each as it is measured, so a run cut short keeps them):
#   real-size  benchmarks/gpu_real_size.py: a Llama 3 8B-shaped bf16 model served over HTTP,
#              TTFT, TPOT and tokens/s at 16, 64 and 256 streams beside the memory floor (240 s)
#   profile    benchmarks/step_profile.py on that model in process (no gRPC): a decode step at
#              1 and 64 rows, one step a call and 8 (queued ahead), the device's busy time
#              beside the step's and the top kernels                                 (2 x 75 s)
#   tests      CUDA graphs against eager steps, prefill attention over a cached prefix, LoRA
#              adapters in a mixed batch, the Triton kernels (decode, split-K decode, prefill
#              over a cached prefix, add+norm (Llama's and Gemma's), rotary+KV write, the
#              sampling draw) and their selection compiled against float64 or PyTorch's ops,
#              a plain decode step's one wait for the device, steps run ahead of their reads
#              against steps one by one, fp8's scaled matmul against its
#              arithmetic, the launcher serving a tiny model on CUDA over HTTP (its router
#              streaming each decode step; an int8 KV cache)                         (190 s)
#   smollm2    decode steps of a SmolLM2-shaped model timed without and with CUDA graphs
#              (2 x 100 s; not in the default run)
#   here, once:  bash scripts/gpu-wheels.sh      (the packages the GPU image lacks, into .whl/)
#   then:        run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
#   or stages:   bash benchmarks/gpu_check.sh tests smollm2
# Logs and figures land in $OUT; the exit status is 1 when a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
stages=${*:-real-size profile tests}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, grpc, google.protobuf, transformers
try:
    import triton; triton = triton.__version__
except ImportError:
    triton = 'none (decode attention gathers in PyTorch)'
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0),
      '| triton', triton, '| grpc', grpc.__version__, '| protobuf', google.protobuf.__version__,
      '| transformers', transformers.__version__)"
status=0
if [[ " $stages " == *" real-size "* ]]; then
    echo "== Llama 3 8B-shaped, bf16, random weights, served over HTTP"
    timeout 240 python3 benchmarks/gpu_real_size.py --json "$out/real-size.json" 2>&1 \
        | tee "$out/real-size.log" || status=1
    echo "== real-size: status $status"
fi
if [[ " $stages " == *" profile "* ]]; then
    echo "== where an 8B-shaped decode step's time goes, in process"
    model=$(python3 benchmarks/gpu_real_size.py --make-only | tail -1)
    for batch in 1 64; do
        timeout 45 python3 benchmarks/step_profile.py --model-dir "$model" --device cuda \
            --dtype bfloat16 --cuda-graphs "$batch" --batch "$batch" --prompt-length 512 \
            --steps 32 --steps-per-call 8 --top 12 --json "$out/profile-$batch.json" 2>&1 \
            | grep -v USDT | tee -a "$out/profile.log" || status=1
        timeout 30 python3 benchmarks/step_profile.py --model-dir "$model" --device cuda \
            --dtype bfloat16 --cuda-graphs "$batch" --batch "$batch" --prompt-length 512 \
            --steps 16 --top 0 2>&1 | grep "decode step p50" | tee -a "$out/profile.log" \
            || status=1
    done
    echo "== profile: status $status"
fi
if [[ " $stages " == *" tests "* ]]; then
    echo "== CUDA graphs against eager steps (tiny model), the launcher and DecodeStream on CUDA"
    timeout 190 python3 -m pytest -q -p no:cacheprovider tests/unit/shard/test_cuda_graphs.py \
        tests/unit/shard/test_attention_dtypes.py tests/unit/shard/test_lora_engine.py \
        tests/unit/shard/test_server_errors.py tests/unit/shard/test_triton_attention.py \
        tests/unit/shard/test_triton_prefill.py tests/unit/shard/test_decode_backend.py \
        tests/unit/shard/test_triton_layer_ops.py tests/unit/shard/test_step_ops.py \
        tests/unit/shard/test_sampling.py tests/unit/shard/test_run_ahead.py \
        tests/unit/shard/test_attention_window.py tests/unit/shard/test_fp8.py \
        tests/e2e/test_shard_decode_stream.py \
        tests/e2e/test_launcher_tiny.py -k "not compiled" 2>&1 | tee "$out/tests.log" | tail -25 \
        || status=1
    echo "== tests: status $status"
fi
if [[ " $stages " == *" smollm2 "* ]]; then
    echo "== decode steps, SmolLM2-135M-shaped random weights, bf16"
    python3 benchmarks/random_model.py --out /tmp/smollm2-shaped || exit 1
    for graphs in 0 1,2,4,8,16,32; do
        timeout 100 python3 benchmarks/engine_bench.py --model-dir /tmp/smollm2-shaped \
            --device cuda --dtype bfloat16 --cuda-graphs "$graphs" --batch-sizes 1,2,8,32,48 \
            --prefill-batch-sizes 1 --prompt-lengths 128 --steps 32 \
            --json "$out/engine-graphs-${graphs//,/-}.json" 2>&1 | tee -a "$out/engine.log" \
            || status=1
        echo "== engine_bench --cuda-graphs $graphs: status $status"
    done
fi
exit $status
