"""build_device_side: everything that touches the device, built as one unit.

It constructs the model, the KV pool, the attention backend and the runner as its
own locals and returns a DeviceBuild: plain DeviceSpecs the control plane plans
with, and the DeviceHandle (device_handle.py) -- the complete list of what the
control plane may ask of the device side, as named operations. The control plane
never holds a model, a pool or a backend, so it cannot pass one along or change one
a forward uses.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.cache.executor import HostCacheExecutor
from tokenspeed_aio.cache.host_pool import HostSizing, allocate_host_pages, check_host_memory
from tokenspeed_aio.cache.l3.factory import build_l3, deployment_identity
from tokenspeed_aio.cache.snapshot_pool import SlotStates
from tokenspeed_aio.data_plane.cuda_graph import default_capture_sizes
from tokenspeed_aio.data_plane.device_handle import DeviceHandle
from tokenspeed_aio.data_plane.grammar_mask import warm_up_bitmask_kernel
from tokenspeed_aio.data_plane.kv_calibration import set_kv_scales
from tokenspeed_aio.data_plane.memory_profile import (
    PENALTY_BYTES_PER_LOGIT,
    SAMPLER_BYTES_PER_LOGIT,
    activation_peak_bytes,
)
from tokenspeed_aio.data_plane.memory_saver import MemorySaver
from tokenspeed_aio.data_plane.profiler import ForwardProfiler
from tokenspeed_aio.data_plane.runner import ModelRunner
from tokenspeed_aio.data_plane.specs import DeviceSpecs, RankInfo
from tokenspeed_aio.data_plane.weight_updates import WeightUpdater
from tokenspeed_aio.guards.compile_monitor import compile_monitor
from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.model.attention.registry import create_backend
from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.kv_cache import (
    kv_cache_bytes_per_block,
    local_num_kv_heads,
    resolve_kv_cache_dtype,
)
from tokenspeed_aio.model.loader import load_model, resolve_dtype
from tokenspeed_aio.model.ops.determinism import set_batch_invariant
from tokenspeed_aio.model.parallel import init_tensor_parallel
from tokenspeed_aio.model.quantization.config import resolve_quantization
from tokenspeed_aio.model.sampling.sampler import warm_up_sampling_kernel
from tokenspeed_aio.pd.factory import build_transfer_peer
from tokenspeed_aio.pd.peer import PeerControl

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceBuild:
    specs: DeviceSpecs
    handle: DeviceHandle
    # The PD transfer peer's control face (registration, cancel, the poll); None for a
    # plain engine.
    transfer: PeerControl | None = None


def resolve_device(name: str, local_index: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: cuda was requested but no CUDA device is available")
        return torch.device("cuda", local_index)
    return torch.device("cpu")


def _init_tensor_parallel(rank: RankInfo, device: torch.device) -> None:
    if rank.tp_size > 1:
        host, port = rank.dist_init_method.removeprefix("tcp://").rsplit(":", 1)
        store = _tp_store(host, int(port), rank.tp_rank, rank.tp_size)
        options = None
        if device.type == "cuda":
            if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
                os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one node: loopback only
        else:  # gloo's pair sockets on the rendezvous host's interface, not the hostname's
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank.tp_rank,
            world_size=rank.tp_size,
            pg_options=options,
        )
    init_tensor_parallel(rank.tp_rank, rank.tp_size)


def _tp_store(host: str, port: int, tp_rank: int, tp_size: int) -> dist.TCPStore:
    """The TP group's rendezvous store. TP rank 0 serves it on a socket it bound to
    ``host`` itself: torch's own store would listen on every interface."""
    if tp_rank:
        return dist.TCPStore(host, port, tp_size, is_master=False)
    listener = socket.create_server((host, port), backlog=max(64, tp_size))
    return dist.TCPStore(
        host, port, tp_size, is_master=True, master_listen_fd=listener.detach(),
        wait_for_workers=False,
    )  # fmt: skip


GRAPH_POOL_RESERVE = 512 * 2**20  # captured decode graphs' memory pool, measured small
GRAPH_BYTES_PER_LOGIT = 8  # and per captured row and vocabulary entry: its logits, argmax
CPU_MAX_NUM_SEQS = 256
GPU_MAX_NUM_SEQS = 1024
SAMPLER_SHARE = 0.04  # of device memory, for the sampler's per-row buffers at most


def max_num_seqs_for(args: EngineArgs, device: torch.device, vocab_size: int) -> int:
    """--max-num-seqs, else 256 on CPU and, on a GPU, 1024 or as many as keep the sampler's
    per-row memory (its largest batch's temporaries, the penalty state) under 4% of the
    device, a multiple of 8."""
    if args.max_num_seqs is not None:
        return args.max_num_seqs
    if device.type != "cuda":
        return CPU_MAX_NUM_SEQS
    total = torch.cuda.get_device_properties(device).total_memory
    per_row = vocab_size * (SAMPLER_BYTES_PER_LOGIT + PENALTY_BYTES_PER_LOGIT)
    fits = int(SAMPLER_SHARE * total // per_row) // 8 * 8
    return max(8, min(GPU_MAX_NUM_SEQS, fits))


def _num_blocks(
    args: EngineArgs,
    device: torch.device,
    per_block: int,
    max_model_len: int,
    peak: int,
    max_num_seqs: int,
    graph_bytes: int,
) -> int:
    """KV pool size: fixed by --num-kv-blocks, else what the memory budget holds after
    the weights, the profiled activation peak and the decode graphs' pool, but never more
    than every slot at full context needs."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    useful = max_num_seqs * -(-max_model_len // args.page_size) + 1
    if device.type == "cuda":
        with allow_host_sync():
            torch.cuda.synchronize(device)
            free, total = torch.cuda.mem_get_info(device)
        reserve = (1 - args.gpu_memory_utilization) * total + peak + graph_bytes
        budget = free - reserve
    else:
        budget = args.kv_cache_memory_gb * 2**30
    blocks = int(budget // per_block)
    if blocks < 2:
        raise ValueError(
            f"no memory left for the KV cache ({budget / 2**30:.2f} GiB budget, "
            f"{per_block} bytes per block): raise gpu_memory_utilization/kv_cache_memory_gb"
        )
    return min(blocks, useful)


def _backend_name(name: str, device: torch.device) -> str:
    """``auto``: our Triton kernels on CUDA (faster than FlashInfer's on the H200, see
    docs/design/attention-backends.md); the torch reference on CPU."""
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" else "torch"


def build_device_side(args: EngineArgs, rank: RankInfo) -> DeviceBuild:
    compile_monitor().begin_startup()  # hooked before anything compiles
    set_batch_invariant(args.enable_deterministic_inference)  # before the model runs
    config = ModelConfig.from_pretrained(args.model)
    device = resolve_device(args.device, rank.local_device_index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(args.dtype, config)
    max_model_len = args.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    if config.sliding_window is not None and max_model_len > config.sliding_window:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's sliding window "
            f"({config.sliding_window}); sliding-window attention is not supported"
        )
    quantization = resolve_quantization(args.quantization, config.quantization)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    backend_name = _backend_name(args.attention_backend, device)
    if kv_dtype == torch.float8_e4m3fn and backend_name == "flashinfer":
        raise ValueError("kv_cache_dtype: fp8 is not supported by the flashinfer backend")
    _init_tensor_parallel(rank, device)
    model = load_model(
        config, args.model, dtype=dtype, device=device, load_format=args.load_format,
        seed=args.seed, quantization=quantization,
    )  # fmt: skip
    memory = MemorySaver(device, vmm=args.enable_memory_saver)
    memory.adopt_weights(model)
    max_num_seqs = max_num_seqs_for(args, device, config.vocab_size)
    kv_heads = local_num_kv_heads(config.num_key_value_heads, rank.tp_size)
    page = args.page_size
    per_block = kv_cache_bytes_per_block(
        config.num_hidden_layers, page, kv_heads, config.head_dim, kv_dtype
    )
    backend = create_backend(
        backend_name,
        max_model_len=max_model_len,
        page_size=page,
        num_q_heads=config.num_attention_heads // rank.tp_size,
        num_kv_heads=kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
        device=device,
    )
    kv_scales = None
    if kv_dtype == torch.float8_e4m3fn:  # the attention layers' buffers, set in place
        set_kv_scales(args, config, model, backend, kv_heads, dtype, device, max_model_len)
        kv_scales = model.kv_scales()
    peak = 0
    if device.type == "cuda":  # also the prefill path's warm-up: kernels compile now
        peak = activation_peak_bytes(
            model,
            backend,
            num_layers=config.num_hidden_layers,
            num_kv_heads=kv_heads,
            head_dim=config.head_dim,
            dtype=kv_dtype,
            kv_scales=kv_scales,
            device=device,
            page_size=page,
            num_tokens=min(args.chunked_prefill_size, max_model_len),
            num_sampling_rows=max_num_seqs,
            vocab_size=config.vocab_size,
        )
    graphs = device.type == "cuda" and not args.enforce_eager and backend.supports_cuda_graphs
    capture_sizes = []
    if graphs:
        largest = min(args.max_cudagraph_capture_size or max_num_seqs, max_num_seqs)
        capture_sizes = sorted(
            s for s in args.cudagraph_capture_sizes or default_capture_sizes(largest)
            if s <= max_num_seqs
        )  # fmt: skip
    graph_bytes = 0
    if capture_sizes:
        graph_bytes = GRAPH_POOL_RESERVE
        graph_bytes += capture_sizes[-1] * config.vocab_size * GRAPH_BYTES_PER_LOGIT
    num_blocks = _num_blocks(
        args, device, per_block, max_model_len, peak, max_num_seqs, graph_bytes
    )
    if rank.tp_size > 1:  # every rank of the replica must plan with the same pool
        agreed = torch.tensor([num_blocks], dtype=torch.int64, device=device)
        with allow_host_sync():
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            num_blocks = int(agreed.item())
    k_caches, v_caches = memory.allocate_kv_cache(
        config.num_hidden_layers, num_blocks, page, kv_heads, config.head_dim, kv_dtype
    )
    transfer = build_transfer_peer(args, rank.tp_rank, rank.tp_size, k_caches, v_caches)
    runner = ModelRunner(
        model=model,
        vocab_size=config.vocab_size,
        k_caches=k_caches,
        v_caches=v_caches,
        kv_scales=kv_scales,
        backend=backend,
        page_size=page,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        eos_token_ids=config.eos_token_ids,
        device=device,
    )
    memory.bind_runner(runner)
    if capture_sizes:
        runner.capture_graphs(capture_sizes)
    if device.type == "cuda":
        runner.warm_up_eager(max_num_seqs)
        warm_up_sampling_kernel(config.vocab_size, dtype, device)
        if args.grammar_backend == "xgrammar":
            warm_up_bitmask_kernel(config.vocab_size, device)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d concurrent tokens (%.2f GiB, %s); activation "
        "peak %.2f GiB; weights %s",
        num_blocks - 1,
        page,
        (num_blocks - 1) * page,
        num_blocks * per_block / 2**30,
        str(kv_dtype).removeprefix("torch."),
        peak / 2**30,
        quantization.scheme if quantization else str(dtype).removeprefix("torch."),
    )
    host = HostSizing.of(
        ratio=args.host_tier_ratio,
        size_gb=args.kvstore_size_gb,
        device_blocks=num_blocks,
        block_bytes=per_block,
        max_num_seqs=max_num_seqs,
    )
    cache = _host_cache(args, host, memory, runner, per_block)
    storage = None
    if args.kvstore_storage_backend is not None:
        identity = deployment_identity(
            args, config.architecture, dtype, cache.host_pages, rank.tp_rank, rank.tp_size,
            kv_scales,
        )  # fmt: skip
        storage = build_l3(args, identity, cache.host_pages)
    specs = DeviceSpecs(
        num_blocks=num_blocks,
        page_size=page,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        vocab_size=config.vocab_size,
        eos_token_ids=config.eos_token_ids,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        attention_backend=backend_name,
        kv_bytes_per_block=per_block,
        host_blocks=host.l2_blocks,
        snapshot_pages=host.snapshot_pages,
        snapshot_states=host.snapshot_states,
        role=args.disaggregation_mode,
        storage=storage is not None,
    )
    engine_rank = rank.dp_rank * rank.tp_size + rank.tp_rank
    weights = WeightUpdater(model, config, device, engine_rank=engine_rank, tp_rank=rank.tp_rank)
    handle = DeviceHandle(
        runner,
        device,
        memory=memory,
        weights=weights,
        profiler=ForwardProfiler(device, engine_rank),
        cache=cache,
        transfer=transfer,
        storage=storage,
    )
    return DeviceBuild(
        specs=specs,
        handle=handle,
        transfer=None if transfer is None else PeerControl(transfer),
    )


def _host_cache(
    args: EngineArgs, host: HostSizing, memory: MemorySaver, runner: ModelRunner, per_block: int
) -> HostCacheExecutor:
    """The host tiers' buffers (none with the tier off) and the executor of cache ops."""
    kv = memory.kv_pool()
    pinned = kv.device.type == "cuda"
    host_pages = snapshot_pages = states = None
    if host.l2_blocks:
        check_host_memory(host.bytes(per_block), len(args.local_ranks), pinned)
        page_shape = (kv.shape[0], kv.shape[1], *kv.shape[3:])
        with allow_host_sync():
            host_pages = allocate_host_pages(host.l2_blocks, page_shape, kv.dtype, pinned)
            snapshot_pages = allocate_host_pages(host.snapshot_pages, page_shape, kv.dtype, pinned)
            states = SlotStates(host.snapshot_states, runner.sampling.vocab_size, pinned)
        logger.info(
            "L2 host KV pool: %d blocks = %d tokens (%.2f GiB %s, %s); snapshot pool: %d "
            "pages (%.2f GiB) and %d slot states",
            host.l2_blocks,
            host.l2_blocks * kv.shape[3],
            host.l2_blocks * per_block / 2**30,
            "pinned" if pinned else "host memory",
            args.kvstore_write_policy,
            host.snapshot_pages,
            host.snapshot_pages * per_block / 2**30,
            host.snapshot_states,
        )
    else:
        logger.info("L2 host KV pool: off (--kvstore-ratio / --kvstore-size-gb)")
    return HostCacheExecutor(
        memory.kv_pool,
        host_pages=host_pages,
        snapshot_pages=snapshot_pages,
        slot_states=states,
        sampling=runner.sampling,
        last_sampled=runner.last_sampled,
    )
