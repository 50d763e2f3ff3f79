"""The router's stop: requests that finish within --drain-timeout are answered; the rest get a 503
(a stream its error event) from the router itself, never a cut connection."""
import asyncio
import json

from tests.unit.router.test_api_errors import HealthyFake, _body, _client
from tests.waiting import wait_until_async


def _events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


async def test_requests_past_the_drain_end_with_a_503_and_an_error_event(tiny_llama):
    fake = HealthyFake(step_delay=0.02)  # 60 tokens take over a second, past the 0.3 s drain
    client = await _client(tiny_llama, fake, drain_timeout=0.3)
    try:
        long = asyncio.ensure_future(client.post("/generate", json=_body(max_new_tokens=60)))
        stream = await client.post("/generate_stream", json=_body(max_new_tokens=60))
        assert stream.status == 200
        first = await stream.content.readline()
        assert first.startswith(b"data:{")
        await wait_until_async(lambda: len(fake.generated) == 2, "both requests to be running")
        short = asyncio.ensure_future(client.post("/generate", json=_body(max_new_tokens=3)))
        await wait_until_async(lambda: len(fake.generated) == 3, "the short one to be running")
        stopping = asyncio.ensure_future(client.server.close())
        short_reply = await short
        assert short_reply.status == 200  # finished within the drain
        reply = await long
        assert reply.status == 503
        assert reply.headers["Content-Type"].startswith("application/json")
        body = await reply.json()
        assert body["error_type"] == "healthcheck"
        assert body["error"].startswith("the server is shutting down")
        events = _events((await stream.content.read()).decode())
        assert events[-1]["error_type"] == "healthcheck", events[-1]
        assert "token" in events[0] and all("token" in e for e in events[:-1])
        await asyncio.wait_for(stopping, 10)
    finally:
        await client.close()
