"""Every flag of TGI 2.x's text-generation-launcher, and its environment variable, is taken by
tgi-launcher: it means what it means in TGI where it can, and is refused at start with a sentence
that says why where it cannot; argparse's "unrecognized arguments" never answers one. Then the
flags that mean something, followed to where they act (router, shard, model)."""
import json
import os

import pytest

from launcher.config import LauncherConfig, parse_args

REFUSED = "refused"

# (TGI's flag and its value, None for a flag that takes none), ...; and REFUSED where tgi-py
# cannot do what it asks. Values are plausible ones from TGI's documentation.
TGI_FLAGS = [
    ([("--model-id", "m")], None),
    ([("--revision", "refs/pr/2")], None),
    ([("--validation-workers", "3")], None),
    ([("--sharded", "false")], None),
    ([("--sharded", "true"), ("--num-shard", "2")], None),
    ([("--num-shard", "2")], None),
    ([("--quantize", "int8")], None),
    # a quantized checkpoint's own method: checked against its config.json once it is found
    *[([("--quantize", kind)], None)
      for kind in ("awq", "compressed-tensors", "gptq", "marlin", "fp8")],
    *[([("--quantize", kind)], REFUSED)
      for kind in ("eetq", "exl2", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")],
    ([("--speculate", "2")], None),
    ([("--dtype", "bfloat16")], None),
    ([("--dtype", "float16")], None),
    ([("--kv-cache-dtype", "fp8_e4m3fn")], REFUSED),
    ([("--kv-cache-dtype", "fp8_e5m2")], REFUSED),
    ([("--trust-remote-code", None)], None),
    ([("--max-concurrent-requests", "64")], None),
    ([("--max-best-of", "1")], None),
    ([("--max-stop-sequences", "2")], None),
    ([("--max-top-n-tokens", "3")], None),
    ([("--max-input-tokens", "1000")], None),
    ([("--max-input-length", "1000")], None),
    ([("--max-total-tokens", "2048")], None),
    ([("--waiting-served-ratio", "1.2")], None),
    ([("--max-batch-prefill-tokens", "4096")], None),
    ([("--max-batch-total-tokens", "16000")], None),
    ([("--max-waiting-tokens", "10")], None),
    ([("--max-batch-size", "8")], None),
    ([("--cuda-graphs", "1,2,4")], None),
    ([("--hostname", "127.0.0.1")], None),
    ([("--port", "3000")], None),
    ([("--prometheus-port", "9000")], None),
    ([("--shard-uds-path", "/tmp/text-generation-server")], None),
    ([("--master-addr", "localhost")], None),
    ([("--master-port", "29501")], None),
    ([("--huggingface-hub-cache", "/data")], None),
    ([("--weights-cache-override", "/data/weights")], None),
    ([("--disable-custom-kernels", None)], None),
    ([("--cuda-memory-fraction", "0.9")], None),
    ([("--rope-scaling", "linear")], None),
    ([("--rope-factor", "2.0")], None),
    ([("--rope-scaling", "dynamic")], REFUSED),
    ([("--json-output", None)], None),
    ([("--otlp-endpoint", "http://localhost:4317")], None),
    ([("--otlp-service-name", "text-generation-inference.router")], None),
    ([("--cors-allow-origin", "https://a.example")], None),
    ([("--api-key", "secret")], None),
    ([("--watermark-gamma", "0.25")], None),
    ([("--watermark-delta", "3.0")], None),
    ([("--ngrok", None)], REFUSED),
    ([("--ngrok-authtoken", "token")], None),
    ([("--ngrok-edge", "edge")], None),
    ([("--tokenizer-config-path", "TOKENIZER_CONFIG")], None),
    ([("--disable-grammar-support", None)], None),
    ([("--max-client-batch-size", "8")], None),
    ([("--lora-adapters", "org/adapter1,org/adapter2")], None),
    ([("--usage-stats", "off")], None),
    ([("--usage-stats", "no-stack")], None),
    ([("--disable-usage-stats", None)], None),
    ([("--disable-crash-reports", None)], None),
    ([("--payload-limit", "1000000")], None),
    ([("--enable-prefill-logprobs", None)], None),
    ([("--graceful-termination-timeout", "90")], None),
]


def _case_id(case) -> str:
    pairs, _ = case
    return " ".join(f"{flag}={value}" if value else flag for flag, value in pairs)


def _value(value, tmp_path) -> str | None:
    if value == "TOKENIZER_CONFIG":  # an existing file
        path = tmp_path / "tokenizer_config.json"
        path.write_text("{}")
        return str(path)
    return value


def _argv(pairs, tmp_path) -> list[str]:
    argv = []
    for flag, value in pairs:
        argv += [flag] if value is None else [flag, _value(value, tmp_path)]
    return argv


def _parse(argv: list[str], capsys) -> LauncherConfig | ValueError:
    """The config, or the ValueError the launcher prints; argparse's own errors fail the test."""
    try:
        return parse_args(argv)
    except ValueError as err:
        return err
    except SystemExit:
        pytest.fail(f"argparse refused {argv}: {capsys.readouterr().err}")


@pytest.fixture(autouse=True)
def _no_flags_in_the_environment(monkeypatch):
    """The machine's own variables (HOSTNAME, PORT, ...) must not decide these tests."""
    for pairs, _ in TGI_FLAGS:
        for flag, _value in pairs:
            monkeypatch.delenv(flag.removeprefix("--").replace("-", "_").upper(), raising=False)


@pytest.mark.parametrize("case", TGI_FLAGS, ids=[_case_id(c) for c in TGI_FLAGS])
def test_every_tgi_flag_is_taken_or_refused_with_a_reason(case, tmp_path, capsys):
    pairs, outcome = case
    parsed = _parse(_argv(pairs, tmp_path), capsys)
    if outcome is REFUSED:
        assert isinstance(parsed, ValueError), f"{pairs} was accepted"
        message = str(parsed)
        assert message.startswith(pairs[0][0]), "the refusal names the flag"
        assert len(message.split()) >= 8, f"a reason, not a bare refusal: {message}"
    else:
        assert isinstance(parsed, LauncherConfig), f"{pairs} refused: {parsed}"


@pytest.mark.parametrize("case", TGI_FLAGS, ids=[_case_id(c) for c in TGI_FLAGS])
def test_every_tgi_flag_is_also_read_from_its_environment_variable(case, tmp_path, capsys,
                                                                    monkeypatch):
    pairs, _ = case
    from_flags = _parse(_argv(pairs, tmp_path), capsys)
    for flag, value in pairs:
        name = flag.removeprefix("--").replace("-", "_").upper()
        monkeypatch.setenv(name, "true" if value is None else _value(value, tmp_path))
    from_environment = _parse([], capsys)
    if isinstance(from_flags, ValueError):
        assert str(from_environment) == str(from_flags)
    else:
        assert from_environment == from_flags


@pytest.mark.parametrize("short, long, value", [("-p", "--port", "3000"), ("-e", "--env", None),
                                                ("-g", "--graceful-termination-timeout", "90")])
def test_tgis_short_flags(short, long, value):
    tail = [] if value is None else [value]
    assert parse_args([short, *tail]) == parse_args([long, *tail])


def test_env_has_no_environment_variable_as_in_tgi(monkeypatch):
    monkeypatch.setenv("ENV", "1")  # some shells export ENV (an rc file) for their own purposes
    assert not parse_args([]).env


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        parse_args(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("tgi-launcher ")


def test_max_input_length_is_the_old_name_of_max_input_tokens():
    config = parse_args(["--max-input-length", "100"])
    assert config.router["max_input_tokens"] == 100
    argv = config.router_argv(tokenizer_path="/m", model_id="m")
    assert argv[argv.index("--max-input-tokens") + 1] == "100"
    with pytest.raises(ValueError, match="--max-input-tokens 50 and --max-input-length 100 are "
                                         "both set"):
        parse_args(["--max-input-length", "100", "--max-input-tokens", "50"])


def test_sharded_true_takes_every_visible_gpu_and_needs_two(monkeypatch):
    from launcher import gpus

    monkeypatch.setattr(gpus, "visible_gpus", lambda environ: ["0", "1", "2"])
    assert parse_args(["--sharded", "true"]).num_shard == 3
    assert parse_args(["--sharded", "false"]).num_shard == 1
    assert parse_args(["--sharded", "false", "--num-shard", "2"]).num_shard == 2  # as TGI
    assert parse_args([]).num_shard == 1
    with pytest.raises(ValueError, match="--sharded true with --num-shard 1"):
        parse_args(["--sharded", "true", "--num-shard", "1"])
    with pytest.raises(ValueError, match=r"serves on the CPU \(--device cpu\). On the CPU give "
                                         "--num-shard N"):
        parse_args(["--sharded", "true", "--device", "cpu"])
    monkeypatch.setattr(gpus, "visible_gpus", lambda environ: ["0"])
    with pytest.raises(ValueError, match="1 GPU"):
        parse_args(["--sharded", "true"])
    assert parse_args(["--sharded", "FALSE"]).num_shard == 1  # any case, as TGI's clap
    monkeypatch.setenv("SHARDED", "yes please")  # argparse checks the flag, the config its variable
    with pytest.raises(ValueError, match="must be true or false"):
        parse_args([])


def test_kv_cache_dtype_is_the_models_dtype():
    assert parse_args(["--kv-cache-dtype", "float32"]).dtype == "float32"
    assert parse_args(["--kv-cache-dtype", "float32", "--dtype", "float32"]).dtype == "float32"
    with pytest.raises(ValueError, match="the KV cache is kept in the model's dtype"):
        parse_args(["--kv-cache-dtype", "float16", "--dtype", "bfloat16"])


def test_kv_cache_dtype_int8_goes_to_every_shard_and_refuses_what_cannot_read_it():
    config = parse_args(["--kv-cache-dtype", "int8"])
    assert config.kv_cache_dtype == "int8" and config.dtype is None  # the model keeps its dtype
    for default_model in (True, False):
        argv = config.shard_settings_argv(default_model=default_model)
        assert argv[argv.index("--kv-cache-dtype") + 1] == "int8"
    assert "--kv-cache-dtype" not in parse_args([]).shard_settings_argv(default_model=True)
    # CUDA's Triton kernels read it too (the shard refuses it where they do not run)
    assert parse_args(["--kv-cache-dtype", "int8", "--device", "cuda"]).kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="int8 with --compile-decode"):
        parse_args(["--kv-cache-dtype", "int8", "--compile-decode"])
    with pytest.raises(ValueError, match="no FP8 KV cache is implemented; int8 is tgi-py's 8-bit"):
        parse_args(["--kv-cache-dtype", "fp8_e4m3fn"])


def test_the_shard_takes_kv_cache_dtype_int8_and_refuses_the_same():
    from shard.config import parse_args as shard_args
    assert shard_args(["--model-path", "m", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    assert shard_args(["--model-path", "m"]).kv_cache_dtype == ""
    assert shard_args(["--model-path", "m", "--kv-cache-dtype", "int8", "--device",
                       "cuda"]).kv_cache_dtype == "int8"
    for extra, reason in ((["--kv-cache-dtype", "fp8_e5m2"], "not one of"),
                          (["--kv-cache-dtype", "int8", "--compile-decode", "1"],
                           "--compile-decode")):
        with pytest.raises(ValueError, match=reason):
            shard_args(["--model-path", "m", *extra])


def test_cors_origins_are_given_once_each_as_in_tgi(monkeypatch):
    config = parse_args(["--cors-allow-origin", "https://a", "--cors-allow-origin", "https://b"])
    argv = config.router_argv(tokenizer_path="/m", model_id="m")
    assert argv[argv.index("--cors-allow-origin") + 1] == "https://a,https://b"
    monkeypatch.setenv("CORS_ALLOW_ORIGIN", "https://c")
    assert parse_args([]).router["cors_allow_origin"] == "https://c"
    assert parse_args(["--cors-allow-origin", "https://a"]).router["cors_allow_origin"] == \
        "https://a"


def test_a_router_flag_without_value_is_forwarded_as_one():
    argv = parse_args(["--disable-grammar-support"]).router_argv(tokenizer_path="/m",
                                                                 model_id="m")
    assert "--disable-grammar-support" in argv
    assert "--disable-grammar-support" not in parse_args([]).router_argv(tokenizer_path="/m",
                                                                         model_id="m")
    from router.config import parse_args as router_args

    assert router_args(["--tokenizer-path", "/m", "--disable-grammar-support"]) \
        .model.disable_grammar_support
    assert not router_args(["--tokenizer-path", "/m"]).model.disable_grammar_support


def test_tgis_router_names_its_tokenizer_tokenizer_name_and_prints_its_schema(capsys):
    from router.__main__ import main as router_main
    from router.config import parse_args as router_args

    assert router_args(["--tokenizer-name", "/models/m"]).model.tokenizer_path == "/models/m"
    assert router_main(["print-schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "/generate" in schema["paths"]


def _spawned_shards(monkeypatch, tmp_path, config: LauncherConfig, *, name: str):
    """(argv, env) of the shard a group of model `name` would start (the default is "m")."""
    from launcher import shard_group
    from launcher.supervisor import Supervisor

    started = []
    monkeypatch.setattr(shard_group, "spawn",
                        lambda child, argv, env, json: started.append((argv, env)))
    Supervisor(config, tmp_path, "m")._group(name, tmp_path, 1, None, "cpu",
                                             uds_prefix=str(tmp_path / "s"), master_port=1,
                                             label="").spawn()
    return started[0]


def test_rope_and_watermark_flags_reach_the_shards_and_the_rope_only_the_default_model(
        monkeypatch, tmp_path):
    from shard.config import parse_args as shard_args

    config = parse_args(["--rope-factor", "2", "--watermark-gamma", "0.25",
                         "--watermark-delta", "3"])
    argv, _ = _spawned_shards(monkeypatch, tmp_path, config, name="m")
    shard = shard_args(argv[argv.index("--model-path"):])
    assert (shard.rope_scaling, shard.rope_factor) == ("linear", 2.0)  # a factor alone: linear
    assert (shard.watermark_gamma, shard.watermark_delta) == (0.25, 3.0)
    other, _ = _spawned_shards(monkeypatch, tmp_path, config, name="another-model")
    other_shard = shard_args(other[other.index("--model-path"):])
    assert other_shard.rope_scaling == "" and other_shard.watermark_gamma == 0.25


def test_disable_custom_kernels_turns_every_c_kernel_off_in_the_shards(monkeypatch, tmp_path):
    from shard.config import DISABLE_KERNELS_ENV, kernel_enabled

    _, env = _spawned_shards(monkeypatch, tmp_path, parse_args(["--disable-custom-kernels"]),
                             name="m")
    assert env[DISABLE_KERNELS_ENV] == "1"
    _, env = _spawned_shards(monkeypatch, tmp_path, parse_args([]), name="m")
    assert env.get(DISABLE_KERNELS_ENV) == os.environ.get(DISABLE_KERNELS_ENV)
    monkeypatch.delenv(DISABLE_KERNELS_ENV, raising=False)
    assert kernel_enabled("TGI_PY_PAGED_KERNEL")
    monkeypatch.setenv(DISABLE_KERNELS_ENV, "1")
    assert not kernel_enabled("TGI_PY_PAGED_KERNEL")


def test_weights_cache_override_is_where_the_models_files_are(tiny_llama, tmp_path,
                                                             monkeypatch):
    from launcher.__main__ import model_source
    from launcher.resolve import ModelResolutionError, resolve_model

    config = parse_args(["--model-id", "org/name", "--weights-cache-override", str(tiny_llama)])
    assert resolve_model(model_source(config)) == tiny_llama
    monkeypatch.chdir(tmp_path)
    missing = parse_args(["--weights-cache-override", "weights"])
    with pytest.raises(ModelResolutionError, match="does not exist"):  # not taken for a Hub id
        resolve_model(model_source(missing))


def test_the_rope_override_and_the_watermark_reach_the_model_and_the_sampler(tiny_llama):
    """A linear factor of 2 doubles the context, and position 2p turns as p did."""
    import torch

    from shard import watermark
    from shard.__main__ import build_engine
    from shard.config import ShardConfig

    plain, _, plain_info, _ = build_engine(ShardConfig(model_path=str(tiny_llama), dtype="float32",
                                                    device="cpu"))
    try:
        scaled, _, info, _ = build_engine(ShardConfig(
            model_path=str(tiny_llama), dtype="float32", device="cpu", rope_scaling="linear",
            rope_factor=2.0, watermark_gamma=0.25, watermark_delta=3.0))
        assert watermark.current() == watermark.WatermarkSettings(0.25, 3.0)
    finally:
        watermark.configure(watermark.WatermarkSettings())
    assert info.max_position_embeddings == 2 * plain_info.max_position_embeddings == 1024
    model, plain_model = scaled.runner.model, plain.runner.model
    assert model.config.rope_scaling["factor"] == 2.0
    positions = torch.arange(0, 512)
    torch.testing.assert_close(model.rotary.cos[2 * positions], plain_model.rotary.cos[positions])
    assert not torch.allclose(model.rotary.cos[1:512], plain_model.rotary.cos[1:512])


def test_the_watermark_settings_are_its_green_share_and_its_bias():
    import torch

    from shard.watermark import WatermarkSettings, apply_watermark, green_list, z_score

    settings = WatermarkSettings(gamma=0.25, delta=3.0)
    assert len(green_list(7, 320, settings)) == 80
    scores = apply_watermark(torch.zeros(2, 320), [1], [7], settings)
    assert scores[0].eq(0).all() and sorted(scores[1].unique().tolist()) == [0.0, 3.0]
    assert int(scores[1].eq(3.0).sum()) == 80
    # all green under gamma 0.25: sqrt(n * 0.75 / 0.25) standard deviations above chance
    tokens, previous = [], 7
    for _ in range(12):
        previous = int(green_list(previous, 320, settings)[0])
        tokens.append(previous)
    assert z_score(tokens, 320, 7, settings) == pytest.approx((12 * 0.75) / (12 * 0.1875) ** 0.5)


# the router's side: a served model built from its settings over a scripted shard


async def _served_app(tiny_llama, **settings):
    from aiohttp.test_utils import TestClient, TestServer

    from router.app import create_app, router_state
    from router.config.model import ModelSettings
    from router.config.server import ServerSettings
    from router.lifecycle import served_model
    from router.shards.convert import ShardInfo
    from tests.fakes import FakeShardClient

    class Shards(FakeShardClient):
        async def info(self):
            return ShardInfo(dtype="float32", device_type="cpu", world_size=1, block_size=4,
                             max_position_embeddings=128, support_chunking=True,
                             use_prefix_caching=False, hidden_size=8, vocab_size=320)

        async def health(self):
            return None

        async def is_same_group_alive(self):
            return True

        async def close(self):
            return None

    async def warm_up(client, config, limits, block_size, **_):
        return 200

    config = ModelSettings(tokenizer_path=str(tiny_llama), **settings)
    state = router_state(ServerSettings(), config)
    original, served_model.warm_up = served_model.warm_up, warm_up
    try:
        served = await served_model._build(config, Shards(), state.models.adapter_links)
    finally:
        served_model.warm_up = original
    state.models.add_default(served)
    client = TestClient(TestServer(create_app(state)))
    await client.start_server()
    return client, state


GRAMMAR = {"type": "json", "value": {"type": "object", "properties": {"a": {"type": "integer"}}}}


async def test_disable_grammar_support_refuses_constrained_requests_in_each_apis_shape(
        tiny_llama):
    client, _ = await _served_app(tiny_llama, disable_grammar_support=True)
    try:
        reply = await client.post("/generate", json={
            "inputs": "hi", "parameters": {"max_new_tokens": 2, "grammar": GRAMMAR}})
        assert reply.status == 422
        assert await reply.json() == {"error": "Input validation error: grammar is not supported",
                                      "error_type": "validation"}  # TGI's words
        reply = await client.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 2,
            "response_format": {"type": "json_object"}})
        assert reply.status == 422
        assert (await reply.json())["error"] == "Input validation error: grammar is not supported"
        reply = await client.post("/generate", json={"inputs": "hi",
                                                      "parameters": {"max_new_tokens": 2}})
        assert reply.status == 200, "unconstrained requests are served"
    finally:
        await client.close()
    client, _ = await _served_app(tiny_llama)
    try:
        reply = await client.post("/generate", json={
            "inputs": "hi", "parameters": {"max_new_tokens": 2, "grammar": GRAMMAR}})
        assert reply.status == 200, await reply.text()
    finally:
        await client.close()


async def test_tokenizer_config_path_gives_the_chat_template_and_special_tokens(tiny_llama,
                                                                              tmp_path):
    template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    path = tmp_path / "elsewhere.json"
    path.write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    client, state = await _served_app(tiny_llama, tokenizer_config_path=str(path))
    try:
        chat = state.served(None).chat_template
        assert chat.render([{"role": "user", "content": "hi"}]) == "<s>[hi]"
    finally:
        await client.close()


async def test_prometheus_port_serves_the_metrics(tiny_llama):
    from aiohttp.test_utils import TestClient, TestServer

    from router.api.tgi.routes import metrics_app

    client, state = await _served_app(tiny_llama)
    metrics = TestClient(TestServer(metrics_app(state)))
    await metrics.start_server()
    try:
        await client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        reply = await metrics.get("/metrics")
        assert reply.status == 200
        assert "tgi_request_success 1" in await reply.text()
        assert (await metrics.get("/generate")).status in (404, 405), "the metrics alone"
    finally:
        await metrics.close()
        await client.close()


@pytest.mark.parametrize("name", ["MAX_INPUT_LENGTH", "ROPE_FACTOR", "PROMETHEUS_PORT",
                                  "USAGE_STATS", "NUM_SHARD", "MAX_TOTAL_TOKENS"])
def test_an_empty_environment_variable_is_unset(monkeypatch, name):
    """Compose files write VAR=${VAR}: set but empty where the user set nothing."""
    monkeypatch.setenv(name, "")
    assert parse_args([]) == parse_args([])
    monkeypatch.delenv(name)
    unset = parse_args([])
    monkeypatch.setenv(name, "")
    assert parse_args([]) == unset
