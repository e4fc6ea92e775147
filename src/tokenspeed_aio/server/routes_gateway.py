"""The routes the SGLang Model Gateway (``sglang-router``) calls to discover and watch a
worker, with SGLang's names and response shapes: GET /server_info and /model_info (and
their older /get_server_info, /get_model_info spellings) and the load report /get_load.
/health_generate and /flush_cache are control routes (routes_control.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from fastapi import APIRouter
from starlette.responses import Response

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.server.body import json_response
from tokenspeed_aio.server.context import ServerContext

# SGLang names a plain engine's mode "null".
MODES = {"plain": "null", "prefill": "prefill", "decode": "decode"}


def _model_config(model: str | None) -> dict:
    path = Path(model or "") / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def gateway_router(ctx: ServerContext, args: EngineArgs) -> APIRouter:
    router = APIRouter()
    config = _model_config(args.model)
    frontend = ctx.frontend
    mode = args.disaggregation_mode

    def server_info() -> dict:
        loads = [load for load, _ in frontend.loads.values()]
        return {
            "model_path": args.model,
            "tokenizer_path": args.tokenizer or args.model,
            "served_model_name": ctx.served_model_name,
            "tp_size": args.tp,
            "dp_size": args.dp,
            "page_size": args.page_size,
            "context_length": frontend.max_model_len,
            "max_running_requests": args.max_num_seqs,
            "max_total_num_tokens": sum(x.total_blocks for x in loads) * args.page_size,
            "chunked_prefill_size": args.chunked_prefill_size,
            "disaggregation_mode": MODES[mode],
            "disaggregation_bootstrap_port": (
                args.disaggregation_bootstrap_port if mode == "prefill" else None
            ),
            "disaggregation_transfer_backend": "mooncake" if mode != "plain" else None,
            "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
            "version": "tokenspeed_aio",
        }

    def model_info() -> dict:
        return {
            "model_path": args.model,
            "tokenizer_path": args.tokenizer or args.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
        }

    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, lambda: json_response(server_info()), methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, lambda: json_response(model_info()), methods=["GET"])

    @router.get("/get_load")
    async def get_load() -> Response:
        """Each replica's load as SGLang reports it (requests, waiting, tokens held)."""
        now = time.perf_counter()
        report = []
        for replica in range(frontend.num_replicas):
            load = frontend.loads.get(replica)
            if load is None:
                continue
            load = load[0]
            used = load.active_blocks * args.page_size
            report.append(
                {
                    "dp_rank": replica,
                    "num_reqs": load.running + load.waiting,
                    "num_waiting_reqs": load.waiting,
                    "num_tokens": used,
                    "num_pending_tokens": load.total_blocks * args.page_size - used,
                    "ts_tic": now,
                }
            )
        return json_response(report)

    return router
