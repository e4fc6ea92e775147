"""GET /health, GET /v1/models, GET /metrics."""

from __future__ import annotations

import httpx
from openai import AsyncOpenAI
from server.conftest import scrape, wait_idle


async def test_health_is_open_and_ok(http_server):
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{http_server.base_url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


async def test_models_lists_the_served_model(http_server):
    oai = AsyncOpenAI(base_url=f"{http_server.base_url}/v1", api_key=http_server.api_key)
    page = await oai.models.list()
    [card] = page.data
    assert card.id == http_server.model and card.object == "model"
    assert card.model_extra["max_model_len"] == http_server.max_model_len


async def test_metrics_count_requests_and_tokens(http_server):
    before = await scrape(http_server.base_url)
    async with httpx.AsyncClient(headers=http_server.headers) as client:
        body = {"prompt": "a b c", "max_tokens": 4, "n": 2, "ignore_eos": True}
        response = await client.post(f"{http_server.base_url}/v1/completions", json=body)
    usage = response.json()["usage"]
    after = await scrape(http_server.base_url)

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert delta('tokenspeed:request_success_total{finished_reason="length"}') == 2
    assert delta("tokenspeed:generation_tokens_total") == usage["completion_tokens"] == 8
    # each choice is an engine request with the prompt's tokens
    assert delta("tokenspeed:prompt_tokens_total") == 2 * usage["prompt_tokens"]
    for name in ("time_to_first_token", "e2e_request_latency"):
        assert delta(f"tokenspeed:{name}_seconds_count") == 2
    assert delta("tokenspeed:time_per_output_token_seconds_count") == 2 * 3
    assert after["tokenspeed:kv_blocks_total"] > 0
    assert after["tokenspeed:num_requests_running"] == 0


async def test_metrics_show_the_frontend_holding_a_stream_and_letting_it_go(http_server):
    """While a 2-choice stream runs, the HTTP layer holds one request of two choices and the
    frontend two streams; once its client leaves, every stage comes back to zero."""
    base, headers = http_server.base_url, http_server.headers
    body = {"prompt": "a b c", "max_tokens": 400, "n": 2, "ignore_eos": True, "stream": True}
    async with (
        httpx.AsyncClient(headers=headers, timeout=60) as client,
        client.stream("POST", f"{base}/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break
        held = await scrape(base)
    assert held["tokenspeed:http_requests_running"] == 1
    assert held["tokenspeed:http_sequences_running"] == 2
    assert held["tokenspeed:frontend_streams"] == 2
    idle = await wait_idle(base)  # every IDLE_GAUGES back to zero, the draining rids too
    assert idle["tokenspeed:frontend_draining_rids"] == 0
