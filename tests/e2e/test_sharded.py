"""--num-shard N serves the same greedy tokens as one shard (gloo tensor parallelism on CPU), on one
machine or split across two launchers as across two machines."""
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import requests

from tests.e2e.server import free_port, launch

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "Paris is the capital of", "Once upon a time there was"]


def _greedy_tokens(server, max_new_tokens=16):
    out = []
    for prompt in PROMPTS:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
        reply = requests.post(f"{server.url}/generate", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        out.append([t["id"] for t in reply.json()["details"]["tokens"]])
    return out


def _serve_and_generate(model_args, tmp_path, num_shard, extra=()):
    # float32: in bf16 the ranks' partial sums round apart from one rank's full ones, so greedy
    # tokens may part after a few (seen on an AVX2 build of the kernels)
    server = launch(model_args, tmp_path / f"shards-{num_shard}",
                    extra=["--num-shard", str(num_shard), "--dtype", "float32", *extra])
    try:
        return _greedy_tokens(server)
    finally:
        assert server.stop() == 0
        assert server.processes_left() == []


def test_two_shards_equal_one_on_a_tiny_llama(tiny_llama, tmp_path):
    extra = ["--max-batch-total-tokens", "4096"]
    one = _serve_and_generate(["--model-id", str(tiny_llama)], tmp_path, 1, extra)
    two = _serve_and_generate(["--model-id", str(tiny_llama)], tmp_path, 2, extra)
    assert two == one


def test_two_machines_on_loopback_equal_one_shard(tiny_llama, tmp_path):
    """Two launchers, one rank each, as on two hosts: machine 1 runs rank 1 and serves it over TCP;
    machine 0 runs rank 0 and the router, which finds rank 1 through service discovery."""
    extra = ["--max-batch-total-tokens", "4096"]
    one = _serve_and_generate(["--model-id", str(tiny_llama)], tmp_path, 1, extra)
    master_port, grpc_port = free_port(), free_port()
    common = ["--model-id", str(tiny_llama), "--num-shard", "2", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--node-address", "127.0.0.1",
              "--shard-grpc-port", str(grpc_port), "--dtype", "float32"]
    # after launch()'s own --master-port, which it would otherwise override
    rendezvous = ["--master-port", str(master_port)]
    log_path = tmp_path / "machine-1.log"
    with open(log_path, "wb") as log:
        machine_1 = subprocess.Popen(
            [sys.executable, "-m", "launcher", *common, *rendezvous, "--node-rank", "1",
             "--shard-uds-path",
             f"/tmp/tgi-py-machine1-{uuid.uuid4().hex[:8]}", "--port", str(free_port()),
             "--model-registry-dir", str(tmp_path / "registry-1")],
            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    try:
        server = launch(common, tmp_path / "machine-0",
                        extra=[*extra, *rendezvous, "--node-rank", "0"])
        try:
            two = _greedy_tokens(server)
        finally:
            assert server.stop() == 0
    finally:
        machine_1.terminate()
        code = machine_1.wait(timeout=60)
    text = log_path.read_text()
    assert f"and 127.0.0.1:{grpc_port + 1}" in text  # rank 1 served the router over TCP
    assert "machine 1 of 2: ranks 1-1" in text and code == 0
    assert two == one


def test_shards_that_do_not_split_evenly_across_machines_are_refused(tiny_llama):
    done = subprocess.run([sys.executable, "-m", "launcher", "--model-id", str(tiny_llama),
                           "--num-shard", "3", "--nnodes", "2"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "must be a multiple of --nnodes 2" in done.stderr


@pytest.mark.real_model
def test_three_shards_equal_one_on_smollm2(real_model_dir, tmp_path):
    extra = ["--max-input-tokens", "200", "--max-total-tokens", "256",
             "--max-batch-prefill-tokens", "256", "--max-batch-total-tokens", "4096"]
    one = _serve_and_generate([], tmp_path, 1, extra)
    three = _serve_and_generate([], tmp_path, 3, extra)
    assert three == one
