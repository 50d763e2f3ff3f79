#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, as one device run of at most about seven minutes (a
# session's device time is short; the stages' timeouts add up to 440 s): CUDA graphs against
# eager steps, prefill attention over a cached prefix, LoRA adapters in a mixed batch, the launcher serving a tiny model on CUDA
# over HTTP (its router streaming each decode step: DecodeStream), and decode steps of a
# SmolLM2-shaped model timed without and with CUDA graphs.
#   here, once:  bash scripts/gpu-wheels.sh      (the packages the GPU image lacks, into .whl/)
#   then:        run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Logs and figures land in $OUT; the exit status is 1 when a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, grpc, google.protobuf, transformers
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0),
      '| grpc', grpc.__version__, '| protobuf', google.protobuf.__version__,
      '| transformers', transformers.__version__)"
status=0
echo "== CUDA graphs against eager steps (tiny model), the launcher and DecodeStream on CUDA"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/shard/test_cuda_graphs.py \
    tests/unit/shard/test_attention_dtypes.py tests/unit/shard/test_lora_engine.py tests/unit/shard/test_server_errors.py tests/e2e/test_shard_decode_stream.py \
    tests/e2e/test_launcher_tiny.py -k "not compiled" 2>&1 | tee "$out/tests.log" | tail -25 \
    || status=1
echo "== tests: status $status"
echo "== decode steps, SmolLM2-135M-shaped random weights, bf16"
python3 benchmarks/random_model.py --out /tmp/smollm2-shaped || exit 1
for graphs in 0 1,2,4,8,16,32; do
    timeout 100 python3 benchmarks/engine_bench.py --model-dir /tmp/smollm2-shaped --device cuda \
        --dtype bfloat16 --cuda-graphs "$graphs" --batch-sizes 1,2,8,32,48 \
        --prefill-batch-sizes 1 --prompt-lengths 128 --steps 32 \
        --json "$out/engine-graphs-${graphs//,/-}.json" 2>&1 | tee -a "$out/engine.log" || status=1
    echo "== engine_bench --cuda-graphs $graphs: status $status"
done
exit $status
