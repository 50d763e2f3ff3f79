"""/info names the architecture the shards serve (`model_architecture`, not in TGI's /info), as
their Info reply says it, and the OpenAPI document describes the field."""
import dataclasses

from proto import generate_pb2 as pb
from router.shards import convert
from router.state import STATE
from tests.unit.router.test_api_errors import HealthyFake, _client


def test_the_shards_info_reply_carries_the_architecture():
    reply = pb.InfoResponse(dtype="float32", device_type="cpu", world_size=1, block_size=4,
                            architecture="Phi3ForCausalLM")
    assert convert.shard_info(reply).architecture == "Phi3ForCausalLM"
    assert convert.shard_info(pb.InfoResponse()).architecture == ""


async def test_info_shows_the_architecture_and_the_document_describes_it(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        served = client.server.app[STATE].served(None)
        served.shard_info = dataclasses.replace(served.shard_info, architecture="Phi3ForCausalLM")
        info = await (await client.get("/info")).json()
        assert info["model_architecture"] == "Phi3ForCausalLM"
        document = await (await client.get("/api-doc/openapi.json")).json()
        field = document["components"]["schemas"]["Info"]["properties"]["model_architecture"]
        assert field["type"] == "string"
    finally:
        await client.close()
