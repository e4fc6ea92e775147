"""GET /health, /v1/models, /metrics, /version, /server_info and /model_info (with SGLang's
older names /get_server_info and /get_model_info) and SGLang's load report /get_load: what
clients and the SGLang Model Gateway read to discover and watch a worker."""

from __future__ import annotations

import json
import time
from importlib import metadata
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenspeed_aio.protocol.openai import ModelCard, ModelList
from tokenspeed_aio.protocol.tokenize import ModelInfo, VersionResponse
from tokenspeed_aio.server.body import json_response
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import error_response

# SGLang names a plain engine's disaggregation mode "null".
SGLANG_MODES = {"plain": "null", "prefill": "prefill", "decode": "decode"}


def checkpoint_config(model_path: str) -> dict:
    """The checkpoint's config.json ({} when there is none to read)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def package_version() -> str:
    try:
        return metadata.version("tokenspeed_aio")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "0.1.0"


def info_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    created = int(time.time())
    version = package_version()

    @router.get("/health")
    async def health() -> Response:
        """200 while the engine serves; 503 naming the reason otherwise."""
        ok, reason = ctx.healthy()
        if ok:
            return json_response({"status": "ok"})
        return error_response(503, f"unhealthy: {reason}", code="unhealthy")

    @router.get("/v1/models")
    async def models() -> Response:
        """One card per served name (vLLM's shape): its context length and, as ``root``,
        the checkpoint it serves."""
        root = ctx.model_path or ctx.served_model_name
        cards = [
            ModelCard(name, created, ctx.frontend.max_model_len, root=root)
            for name in ctx.served_model_names
        ]
        return json_response(ModelList(cards))

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, headers = ctx.metrics.render(
            request.headers.getlist("accept"),
            http_requests=ctx.registry.requests,
            http_sequences=ctx.registry.sequences,
        )
        return Response(body, headers=headers)

    @router.get("/version")
    async def get_version() -> Response:
        return json_response(VersionResponse(version))

    engine = ctx.engine_args
    config = checkpoint_config(ctx.model_path)
    mode = engine.get("disaggregation_mode", "plain")

    async def server_info() -> Response:
        """The engine's settings under SGLang's names (what the SGLang Model Gateway reads to
        discover a worker), the full EngineArgs and server options, and the replicas' loads."""
        frontend = ctx.frontend
        loads = {r: load for r, (load, _) in frontend.loads.items()}
        options = {k: v for k, v in vars(ctx.options).items() if "api_key" not in k}
        page = engine.get("page_size", 1)
        return json_response(
            {
                "model_path": ctx.model_path,
                "tokenizer_path": engine.get("tokenizer") or ctx.model_path,
                "served_model_name": ctx.served_model_name,
                "tp_size": engine.get("tp", 1),
                "dp_size": engine.get("dp", 1),
                "page_size": page,
                "context_length": frontend.max_model_len,
                "max_running_requests": engine.get("max_num_seqs"),
                "max_total_num_tokens": sum(x.total_blocks for x in loads.values()) * page,
                "chunked_prefill_size": engine.get("chunked_prefill_size"),
                "disaggregation_mode": SGLANG_MODES[mode],
                "disaggregation_bootstrap_port": (
                    engine.get("disaggregation_bootstrap_port") if mode == "prefill" else None
                ),
                "disaggregation_transfer_backend": "mooncake" if mode != "plain" else None,
                "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
                "version": version,
                "engine_args": engine,
                "server_args": options,
                "max_model_len": frontend.max_model_len,
                "num_replicas": frontend.num_replicas,
                "loads": {str(r): load for r, load in loads.items()},
            }
        )

    async def model_info() -> Response:
        tokenizer = engine.get("tokenizer") or ctx.model_path
        return json_response(
            ModelInfo(
                model_path=ctx.model_path,
                tokenizer_path=str(tokenizer),
                served_model_name=ctx.served_model_name,
                served_model_names=list(ctx.served_model_names),
                max_model_len=ctx.frontend.max_model_len,
                vocab_size=ctx.frontend.vocab_size,
                weight_version=ctx.frontend.calls.weight_version,
                model_type=config.get("model_type"),
                architectures=config.get("architectures"),
            )
        )

    async def get_load() -> Response:
        """Each replica's load as SGLang reports it (requests, waiting, tokens held); the
        SGLang Model Gateway polls it."""
        now = time.perf_counter()
        page = engine.get("page_size", 1)
        report = []
        for replica in range(ctx.frontend.num_replicas):
            entry = ctx.frontend.loads.get(replica)
            if entry is None:
                continue
            load = entry[0]
            used = load.active_blocks * page
            report.append(
                {
                    "dp_rank": replica,
                    "num_reqs": load.running + load.waiting,
                    "num_waiting_reqs": load.waiting,
                    "num_tokens": used,
                    "num_pending_tokens": load.total_blocks * page - used,
                    "ts_tic": now,
                }
            )
        return json_response(report)

    router.add_api_route("/get_load", get_load, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info, methods=["GET"])
    return router
