"""The engine's ``serve``/``bench`` flags: one per EngineArgs field, with its help text
and the aliases other engines' launch scripts spell it with."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from tokenspeed_aio.args import KVSTORE_STORAGE_DEFAULT_RATIO, EngineArgs

ENGINE_HELP = {
    "model": "a Hugging Face checkpoint directory, or a hub id (ORG/NAME) found in the local "
    "HF cache or downloaded when online (None: the built-in toy model)",
    "tokenizer": "tokenizer directory (None: the model directory)",
    "served_model_name": "the model name(s) clients use; responses carry the first "
    "(None: the model directory's name, or the hub id)",
    "dtype": "weights and activations dtype: auto (the checkpoint's), float32, bfloat16, float16",
    "quantization": "fp8: quantize a 16-bit checkpoint's linear layers to FP8 (e4m3) at load, "
    "one scale per output channel, activations per token (FP8 checkpoints need no flag)",
    "kv_cache_dtype": "KV cache dtype: auto (the activations') or fp8 (e4m3, per-head scales: "
    "--kv-cache-scales; the pool holds twice the tokens)",
    "kv_cache_scales": "an FP8 KV cache's per-layer, per-KV-head scales: auto (the "
    "checkpoint's where it stores them, else calibrate), calibrate (from one 16-bit prefill "
    "of a built-in text at startup), unit (1.0, vLLM's default)",
    "load_format": "auto/safetensors: read the checkpoint's weights; dummy: random weights",
    "device": "auto (cuda when available), cpu or cuda",
    "seed": "seed of dummy weights",
    "tp": "tensor-parallel ranks per replica",
    "dp": "attention data-parallel replicas",
    "nnodes": "machines the engine's ranks span",
    "node_rank": "this machine's index (node 0 runs the HTTP frontend)",
    "dist_init_addr": "HOST:PORT on node 0 that every node reaches (needed when nnodes > 1); "
    "node 0 listens on PORT to PORT+2+dp, so pick a PORT below the OS's ephemeral range",
    "page_size": "tokens per KV-cache block (a power of two)",
    "max_model_len": "context length (default: the model's max_position_embeddings)",
    "max_num_seqs": "most requests running at once (default: 256 on CPU; on a GPU 1024, or "
    "fewer where the sampler's per-row memory would pass 4%% of the device's)",
    "chunked_prefill_size": "token budget of one scheduling round (long prompts are chunked)",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "in_flight_depth": "forwards dispatched ahead of their commit (0: none, 1: overlap)",
    "num_kv_blocks": "fix the KV pool size in blocks (default: sized from memory)",
    "kv_cache_memory_gb": "CPU: memory for the KV cache, GiB",
    "gpu_memory_utilization": "GPU: fraction of device memory the engine may use",
    "attention_backend": "auto (triton on CUDA, torch on CPU), torch, triton, or flashinfer "
    "(needs the flashinfer-python package, 16-bit dtypes)",
    "enforce_eager": "GPU: no CUDA graphs",
    "max_cudagraph_capture_size": "GPU: largest decode batch captured in a CUDA graph "
    "(default: max_num_seqs)",
    "cudagraph_capture_sizes": "GPU: exact decode batch sizes to capture",
    "chat_template": "a jinja chat template, or a file holding one (default: the tokenizer's)",
    "grammar_backend": "structured output (json_schema, regex, ebnf): xgrammar or none",
    "grammar_compile_timeout_secs": "a grammar not compiled within this fails its request",
    "kvstore_ratio": "L2 host KV cache tier (pinned host memory on GPU), sized as this many "
    "times the device KV pool; 0 (the default) turns it off",
    "kvstore_size_gb": "L2 host KV cache tier size in GiB per rank (instead of --kvstore-ratio)",
    "kvstore_write_policy": "write_through: every full cached block goes to L2 as it is cached; "
    "write_back: a device block goes to L2 only when it is evicted",
    "kvstore_storage_backend": "L3 storage tier shared by every engine serving the same model: "
    "mooncake (the Mooncake distributed store) or file (a directory); turns the L2 tier on "
    f"(--kvstore-ratio {KVSTORE_STORAGE_DEFAULT_RATIO:g}) unless it is sized",
    "kvstore_storage_dir": "file backend: the directory holding the L3 pages",
    "kvstore_storage_timeout": "seconds an L3 storage operation may take; a slower one fails "
    "and its request recomputes",
    "kvstore_mooncake_master": "mooncake backend: HOST:PORT of mooncake_master's RPC service",
    "kvstore_mooncake_metadata_server": "mooncake backend: the transfer metadata server "
    "(default: http://MASTER_HOST:8080/metadata, the master's --enable_http_metadata_server)",
    "kvstore_mooncake_segment_gb": "mooncake backend: GiB of memory each rank lends the store",
    "enable_memory_saver": "GPU: keep the weights and KV cache in CUDA virtual memory, so "
    "/release_memory_occupation gives their memory back and CUDA graphs survive it",
    "weight_version": "the weights' version reported until a weight update sets another",
    "kv_events_endpoint": "publish KV-cache events (vLLM's msgpack batches) on this ZMQ PUB "
    "endpoint, e.g. tcp://*:5557 (attention-DP replica r: port + 2r)",
    "kv_events_replay_endpoint": "the KV events' replay ROUTER endpoint (default: PUB port + 1)",
    "kv_events_queue_size": "KV-event batches queued for the publisher thread; more are "
    "dropped (and counted)",
    "log_batch_interval": "log a line every N forward rounds: running, waiting, tokens, "
    "throughput, cache hit rate, KV usage (0: off)",
    "log_request_stats": "log one line per finished request (tokens, queue time, TTFT, latency)",
    "enable_async_logging": "log through a bounded, lossy queue drained by a thread, so a "
    "slow log stream never stalls a round",
    "enable_trace": "trace requests with OpenTelemetry (spans: queue, prefill, decode, finish)",
    "trace_provider": "a registered trace provider (register_trace_provider) mapping request "
    "ids to (trace id, parent span id); implies --enable-trace",
    "otlp_traces_endpoint": "export the spans over OTLP to this endpoint (needs "
    "opentelemetry-exporter-otlp); implies --enable-trace",
    "disaggregation_mode": "plain (default), or prefill / decode: one side of a disaggregated "
    "deployment behind the SGLang Model Gateway",
    "disaggregation_bootstrap_port": "prefill: the port of the bootstrap server the decode "
    "engines look transfers up at",
    "disaggregation_bootstrap_timeout": "seconds a transfer room may wait for its peer (an "
    "unclaimed room, a decode waiting for its KV) before it fails",
    "disaggregation_host": "the address this engine's transfer endpoints (the bootstrap "
    "server, the KV senders) listen on and other engines reach them at (default: loopback; "
    "across nodes the interface that reaches --dist-init-addr)",
    "generation_config": "sampling defaults for fields a request leaves unset: auto (the "
    "checkpoint's generation_config.json), vllm (none), or a directory holding one",
    "enable_deterministic_inference": "batch-invariant matmul, attention and sampling: a "
    "request's greedy tokens and logprobs do not depend on what runs beside it (slower)",
}

# Other engines' spellings of our flags, so launch scripts written for vLLM or SGLang run
# unchanged (docs/flags.md).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("--model-path",),
    "tp": ("--tensor-parallel-size", "--tp-size"),
    "dp": ("--data-parallel-size", "--dp-size"),
    "chunked_prefill_size": ("--max-num-batched-tokens",),
    "max_model_len": ("--context-length",),
    "gpu_memory_utilization": ("--mem-fraction-static",),
}


def _flag_type(field: dataclasses.Field):
    hint = typing.get_type_hints(EngineArgs)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) and args:
        hint = args[0]
    return hint


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineArgs):
        names = ("--" + field.name.replace("_", "-"), *FLAG_ALIASES.get(field.name, ()))
        kind = _flag_type(field)
        help_text = ENGINE_HELP[field.name]
        common = dict(dest=field.name, help=help_text)
        if field.name == "served_model_name":
            group.add_argument(*names, nargs="+", default=None, **common)
        elif kind is bool:
            group.add_argument(
                *names, action=argparse.BooleanOptionalAction, default=field.default, **common
            )
        elif typing.get_origin(kind) is list:
            group.add_argument(*names, type=int, nargs="+", default=None, **common)
        else:
            group.add_argument(*names, type=kind, default=field.default, **common)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if getattr(ns, "model_pos", None):
        values["model"] = ns.model_pos
    names = values["served_model_name"]
    if isinstance(names, list) and len(names) == 1:
        values["served_model_name"] = names[0]
    return EngineArgs(**values)
