"""EngineArgs: the engine's settings, one spelling for the CLI and the Python API.

Each field is a ``serve`` flag with dashes turned into underscores. Validation
raises ValueError naming the field and its limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
GRAMMAR_BACKENDS = ("xgrammar", "none")
KVSTORE_WRITE_POLICIES = ("write_through", "write_back")
KVSTORE_STORAGE_BACKENDS = ("mooncake", "file")
# The L2 host tier's size when a storage backend turns it on and none was given
KVSTORE_STORAGE_DEFAULT_RATIO = 2.0
DISAGGREGATION_MODES = ("plain", "prefill", "decode")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
KV_CACHE_SCALES = ("auto", "calibrate", "unit")


@dataclass
class EngineArgs:
    model: str | None = None  # a local HF checkpoint dir or a hub id; None: the default model
    tokenizer: str | None = None  # defaults to the model dir
    served_model_name: str | list[str] | None = None  # the first is the name responses carry
    dtype: str = "auto"
    quantization: str | None = None  # fp8: quantize a 16-bit checkpoint's linear layers at load
    kv_cache_dtype: str = "auto"  # auto: the activations' dtype; fp8 (e4m3): half the bytes
    kv_cache_scales: str = "auto"  # an FP8 cache's: auto (checkpoint's, else calibrate), unit
    load_format: str = "auto"
    device: str = "auto"
    seed: int = 0  # dummy weights' seed
    tp: int = 1
    dp: int = 1
    nnodes: int = 1  # machines the ranks span
    node_rank: int = 0  # this machine's index; node 0 runs the frontend
    dist_init_addr: str | None = None  # HOST:PORT on node 0 every node reaches (nnodes > 1)
    page_size: int = 16
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int | None = None  # None: 256 on CPU, up to 1024 on a GPU (device.py)
    chunked_prefill_size: int = 8192  # per-round token budget
    enable_prefix_caching: bool = True
    in_flight_depth: int = 1  # 0: commit every forward before planning the next
    num_kv_blocks: int | None = None  # fixes the KV pool size (tests); else sized by memory
    kv_cache_memory_gb: float = 2.0  # CPU: memory for the KV pool
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"  # torch | triton | flashinfer
    enforce_eager: bool = False
    max_cudagraph_capture_size: int | None = None  # None: every batch up to max_num_seqs
    cudagraph_capture_sizes: list[int] | None = None
    chat_template: str | None = None  # a file or an inline jinja template
    grammar_backend: str = "xgrammar"  # structured output: xgrammar | none
    grammar_compile_timeout_secs: float = 30.0
    kvstore_ratio: float = 0.0  # L2 host KV pool, x the device pool's blocks (0: off)
    kvstore_size_gb: float | None = None  # ... or its size in GiB, per rank
    kvstore_write_policy: str = "write_through"  # write_through | write_back
    # The L3 storage tier (docs/design/storage-tier.md): none by default
    kvstore_storage_backend: str | None = None  # mooncake | file
    kvstore_storage_dir: str | None = None  # file: where the pages live
    kvstore_storage_timeout: float = 5.0  # seconds a storage op may take before it fails
    kvstore_mooncake_master: str | None = None  # HOST:PORT of mooncake_master
    kvstore_mooncake_metadata_server: str | None = None  # default: the master's HTTP one
    kvstore_mooncake_segment_gb: float = 1.0  # memory this engine lends the store, per rank
    # RL control operations and operators' tools
    enable_memory_saver: bool = False  # CUDA: weights and KV cache in CUDA virtual memory
    weight_version: str = "default"  # the weights' version until an update names another
    kv_events_endpoint: str | None = None  # ZMQ PUB endpoint of the KV-cache events
    kv_events_replay_endpoint: str | None = None  # its replay ROUTER (default: PUB port + 1)
    kv_events_queue_size: int = 10_000  # batches waiting to be sent before new ones drop
    log_batch_interval: int = 0  # log a batch line every N forward rounds (0: off)
    log_request_stats: bool = False  # one log line per finished request
    enable_async_logging: bool = False  # log records go through a bounded lossy queue
    enable_trace: bool = False  # OpenTelemetry spans per request
    trace_provider: str | None = None  # a registered provider of (trace id, parent span)
    otlp_traces_endpoint: str | None = None  # export spans over OTLP (else: the log)
    # Prefill/decode disaggregation (docs/disaggregation.md): the engine's role, where a
    # prefill engine's bootstrap server listens, how long a room may wait for its peer,
    # and the address other engines reach this one's transfer endpoints at.
    disaggregation_mode: str = "plain"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_bootstrap_timeout: float = 300.0
    disaggregation_host: str | None = None
    # Sampling defaults for fields a request leaves unset: "auto" (the checkpoint's
    # generation_config.json), "vllm" (none: the API's own defaults) or a directory.
    generation_config: str = "auto"
    enable_deterministic_inference: bool = False  # batch-invariant kernels (docs/determinism.md)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def host_tier_ratio(self) -> float:
        """The L2 tier's ratio: the given one, or the default a storage backend turns on."""
        if self.kvstore_ratio or self.kvstore_size_gb or self.kvstore_storage_backend is None:
            return self.kvstore_ratio
        return KVSTORE_STORAGE_DEFAULT_RATIO

    def validate(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {message} (got {getattr(self, name)!r})")

        check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        check(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {', '.join(QUANTIZATIONS)}",
        )
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {', '.join(KV_CACHE_DTYPES)}",
        )
        check(
            self.kv_cache_scales in KV_CACHE_SCALES,
            "kv_cache_scales",
            f"must be one of {', '.join(KV_CACHE_SCALES)}",
        )
        check(
            self.load_format in LOAD_FORMATS,
            "load_format",
            f"must be one of {', '.join(LOAD_FORMATS)}",
        )
        check(self.device in DEVICES, "device", f"must be one of {', '.join(DEVICES)}")
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {', '.join(ATTENTION_BACKENDS)}",
        )
        check(self.tp >= 1, "tp", "must be >= 1")
        check(self.dp >= 1, "dp", "must be >= 1")
        check(self.nnodes >= 1, "nnodes", "must be >= 1")
        check(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, {self.nnodes})")
        check(
            (self.tp * self.dp) % self.nnodes == 0,
            "nnodes",
            f"must divide the {self.tp * self.dp} ranks (tp * dp)",
        )
        if self.nnodes > 1:
            check(
                self.dist_init_addr is not None and ":" in self.dist_init_addr,
                "dist_init_addr",
                "HOST:PORT of node 0 is required when nnodes > 1",
            )
        check(
            self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            "page_size",
            "must be a power of two",
        )
        check(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        check(self.chunked_prefill_size >= 1, "chunked_prefill_size", "must be >= 1")
        check(self.in_flight_depth in (0, 1), "in_flight_depth", "must be 0 or 1")
        if self.max_model_len is not None:
            check(self.max_model_len >= 2, "max_model_len", "must be >= 2")
        if self.num_kv_blocks is not None:
            check(self.num_kv_blocks >= 2, "num_kv_blocks", "must be >= 2 (one is the null block)")
        check(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "must be > 0")
        check(
            0.05 <= self.gpu_memory_utilization <= 0.99,
            "gpu_memory_utilization",
            "must be between 0.05 and 0.99",
        )
        check(
            self.max_cudagraph_capture_size is None or self.max_cudagraph_capture_size >= 1,
            "max_cudagraph_capture_size",
            "must be >= 1",
        )
        check(
            self.grammar_backend in GRAMMAR_BACKENDS,
            "grammar_backend",
            f"must be one of {', '.join(GRAMMAR_BACKENDS)}",
        )
        check(self.grammar_compile_timeout_secs > 0, "grammar_compile_timeout_secs", "must be > 0")
        check(self.kvstore_ratio >= 0, "kvstore_ratio", "must be >= 0")
        if self.kvstore_size_gb is not None:
            check(self.kvstore_size_gb >= 0, "kvstore_size_gb", "must be >= 0")
            check(
                not self.kvstore_ratio,
                "kvstore_size_gb",
                "give --kvstore-ratio or --kvstore-size-gb, not both",
            )
        check(
            self.kvstore_write_policy in KVSTORE_WRITE_POLICIES,
            "kvstore_write_policy",
            f"must be one of {', '.join(KVSTORE_WRITE_POLICIES)}",
        )
        if self.kvstore_storage_backend is not None:
            check(
                self.kvstore_storage_backend in KVSTORE_STORAGE_BACKENDS,
                "kvstore_storage_backend",
                f"must be one of {', '.join(KVSTORE_STORAGE_BACKENDS)}",
            )
            check(
                self.enable_prefix_caching,
                "kvstore_storage_backend",
                "the L3 tier shares prefixes: it needs prefix caching",
            )
            check(
                self.disaggregation_mode != "decode",
                "kvstore_storage_backend",
                "a decode engine receives its prompt's KV from its prefill peer, not L3",
            )
            check(
                self.kvstore_storage_backend != "file" or bool(self.kvstore_storage_dir),
                "kvstore_storage_dir",
                "--kvstore-storage-backend file needs a directory",
            )
            check(
                self.kvstore_storage_backend != "mooncake"
                or _host_port(self.kvstore_mooncake_master),
                "kvstore_mooncake_master",
                "--kvstore-storage-backend mooncake needs the master's HOST:PORT",
            )
        check(self.kvstore_storage_timeout > 0, "kvstore_storage_timeout", "must be > 0")
        check(self.kvstore_mooncake_segment_gb > 0, "kvstore_mooncake_segment_gb", "must be > 0")
        if self.kv_events_endpoint is not None:
            check(
                self.kv_events_endpoint.startswith(("tcp://", "ipc://", "inproc://")),
                "kv_events_endpoint",
                "must be a ZMQ endpoint (tcp://HOST:PORT or ipc://PATH)",
            )
        check(self.kv_events_queue_size >= 1, "kv_events_queue_size", "must be >= 1")
        check(self.log_batch_interval >= 0, "log_batch_interval", "must be >= 0")
        check(
            self.disaggregation_mode in DISAGGREGATION_MODES,
            "disaggregation_mode",
            f"must be one of {', '.join(DISAGGREGATION_MODES)}",
        )
        check(
            0 < self.disaggregation_bootstrap_port < 65536,
            "disaggregation_bootstrap_port",
            "must be a TCP port",
        )
        check(
            self.disaggregation_bootstrap_timeout > 0,
            "disaggregation_bootstrap_timeout",
            "must be > 0",
        )
        if self.disaggregation_mode != "plain":
            check(self.dp == 1, "dp", "prefill/decode disaggregation runs one replica (dp=1)")
        if isinstance(self.served_model_name, list):
            check(
                bool(self.served_model_name) and all(self.served_model_name),
                "served_model_name",
                "needs at least one non-empty name",
            )

    @property
    def served_model_names(self) -> list[str]:
        """Every name clients may use for the model (empty: not decided yet)."""
        name = self.served_model_name
        if name is None:
            return []
        return [name] if isinstance(name, str) else list(name)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def _host_port(value: str | None) -> bool:
    host, _, port = (value or "").rpartition(":")
    return bool(host) and port.isdigit()
