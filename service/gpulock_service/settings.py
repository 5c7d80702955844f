"""The service's settings: environment variables ``GPULOCK_<NAME>`` (or a ``.env`` file), or a
:class:`Settings` object passed to ``create_app``. docs/SERVICE.md has the table."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from gpulock_common.options import DEFAULT_TTL_S, PRIORITY_MAX, PRIORITY_MIN, TENANT_PATTERN

from gpulock.errors import InvalidArgument
from gpulock.protocol.args import MAX_KEEP_S
from gpulock.units import parse_seconds, parse_size

# Without a GPU the pool still needs a capacity: 2 GiB leaves room for 4 workers' resident
# leases (4 x 128 MiB) and about a dozen MiniLM requests of 64 sentences at once.
CPU_DEFAULT_CAPACITY = "2GiB"
# What one worker keeps resident on a CPU "device": the all-MiniLM-L6-v2 weights are 87 MiB
# (90,868,376 bytes of safetensors); with the tokenizer and PyTorch's buffers, 128 MiB.
CPU_DEFAULT_RESIDENT = "128MiB"
# The CUDA context (kernels, cuBLAS/cuDNN workspaces) that torch.cuda.memory_reserved does not
# see: typically 300-600 MiB on recent GPUs with lazy module loading. Measure yours with
# nvidia-smi (process memory) minus torch.cuda.memory_reserved().
DEFAULT_CUDA_CONTEXT = "512MiB"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GPULOCK_", env_file=".env", extra="ignore", protected_namespaces=()
    )

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the pool")
    pool: str = Field("gpu0", description="pool name (one per GPU)")
    capacity: str | None = Field(
        None, description="pool capacity; the pool is created with it if missing"
    )
    configure: Literal["create", "set"] = Field(
        "create", description="'set' overwrites an existing capacity"
    )
    max_waiters: int | None = Field(
        None, description="queue bound of the pool (when this service creates it)"
    )

    model: str = Field(
        "minilm", description="'minilm', 'sleep' (test model) or 'package.module:factory'"
    )
    model_name: str | None = Field(
        None, description="name reported in responses (default: the model's)"
    )
    generation_model: str = Field(
        "auto",
        description="the model of /v1/chat/completions and /v1/completions: 'tiny' (a small "
        "causal LM with random weights, built on first use: meaningless text), a local Hugging "
        "Face causal-LM folder (PATH), 'none' (no generation routes), or 'auto' (tiny beside "
        "the minilm embedding model, else none)",
    )
    generation_model_name: str | None = Field(
        None, description="name the generative model is served as (default: its own)"
    )
    generation_max_tokens: int = Field(
        256,
        ge=1,
        description="most tokens one generation may ask (max_tokens), and the default when it "
        "does not say (less when the model's context leaves less)",
    )
    generation_chunk_tokens: int = Field(
        4, ge=1, le=256, description="tokens generated per step (forward passes between checks)"
    )
    generation_growth: Literal["reserve_max", "grow"] = Field(
        "reserve_max",
        description="how a generation's lease follows its KV cache: 'reserve_max' leases prompt "
        "+ max_tokens up front (never waits or fails once admitted); 'grow' leases prompt + "
        "GPULOCK_GENERATION_GROWTH_TOKENS and grows the lease by that many tokens at a time "
        "(more generations fit; a growth may wait up to GPULOCK_ACQUIRE_TIMEOUT, or be refused)",
    )
    generation_growth_tokens: int = Field(
        64,
        ge=1,
        description="grow: new tokens the first lease covers and each growth adds",
    )
    device: str = Field("auto", description="'auto' (CUDA if available), 'cpu', 'cuda:0', ...")
    resident: str | None = Field(
        None,
        description="bytes per worker for its resident lease; "
        "'0' for none; unset: measured on CUDA, cpu_resident on CPU",
    )
    cpu_resident: str = Field(
        CPU_DEFAULT_RESIDENT, description="resident lease per worker on a CPU device"
    )
    cuda_context: str = Field(
        DEFAULT_CUDA_CONTEXT, description="CUDA context added to the measured resident bytes"
    )
    calibrate: bool = Field(
        False, description="on CUDA: measure per-shape peaks at start and share them in Redis"
    )

    ttl: float = Field(DEFAULT_TTL_S, gt=0, description="lease ttl, seconds (heartbeat at ttl/3)")
    acquire_timeout: float = Field(10.0, gt=0, description="seconds to wait for a grant before 503")
    inference_timeout: float = Field(30.0, gt=0, description="seconds of inference before 504")
    startup_timeout: float = Field(
        20.0, ge=0, description="seconds the worker start waits for lease + model"
    )
    park_timeout: float = Field(
        30.0, ge=0, description="seconds a 503'd request with X-Request-ID keeps its place"
    )
    result_ttl: float = Field(
        60.0, gt=0, description="seconds a result is kept for retries (X-Request-ID)"
    )
    reaper_interval: float = Field(
        1.0, gt=0, description="seconds between background status reads/reaps"
    )

    max_batch: int = Field(256, ge=1, description="most inputs per request (else 413)")
    max_tokens: int = Field(
        256,
        ge=8,
        description="most tokens the model reads of one input (at most the model's own: 256 "
        "for MiniLM); a longer input is a 400 unless truncated",
    )
    truncate: bool = Field(
        False,
        description="default of a request's 'truncate': true embeds an input over max_tokens "
        "from its first tokens, false refuses it (400 context_length_exceeded)",
    )
    max_request_bytes: str = Field(
        "16MiB", description="largest request body (else 413 before it is parsed)"
    )
    read_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a request's head, and its body, may take "
        "to arrive (else 408 and the connection is closed)",
    )
    executor_threads: int = Field(2, ge=1, description="threads running inference per worker")
    batch: bool = Field(
        True, description="dynamic batching: concurrent requests of a worker run as one model call"
    )
    batch_max_size: int = Field(32, ge=1, description="most requests in one batch")
    batch_max_wait_ms: float = Field(
        5.0, ge=0, description="most milliseconds a batch stays open for more requests"
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch.set_num_threads per worker (CPU)"
    )

    priority: int = Field(
        0,
        ge=PRIORITY_MIN,
        le=PRIORITY_MAX,
        description="priority of /v1/embeddings requests in the pool's queue (higher first); "
        "matters against other services sharing the pool",
    )
    priority_header: str | None = Field(
        None,
        pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$",
        description="request header whose integer value replaces GPULOCK_PRIORITY, at most "
        "GPULOCK_MAX_PRIORITY (e.g. X-GpuLock-Priority); unset: no header is read",
    )
    max_priority: int | None = Field(
        None,
        ge=PRIORITY_MIN,
        le=PRIORITY_MAX,
        description="most a request's priority header may ask; unset: GPULOCK_PRIORITY "
        "(the header can only lower it)",
    )

    tenant: str | None = Field(
        None,
        pattern=f"^{TENANT_PATTERN}$",
        description="tenant every lease of this service counts under: the pool's quota for "
        "it (gpulock pool set --quota TENANT=SIZE) caps what the service holds; unset: none",
    )

    keep: float = Field(
        0.0,
        description="seconds (0.1-3600) a worker may keep a released lease's bytes, idle, to "
        "grant its next request of the same size from them with no Redis round trip, while "
        "nobody waits in the pool; 0: off",
    )

    sleep_seconds: float = Field(1.0, ge=0, description="sleep model: seconds per request")
    sleep_bytes: str = Field("256MiB", description="sleep model: bytes per input")

    disabled: bool = Field(
        False, description="run without leases (to measure the lease's overhead)"
    )
    dashboard: bool = Field(
        True,
        description="serve /dashboard (the live view of the pool) and sample the pool's "
        "history into Redis",
    )
    exit_on_fatal: bool = Field(True, description="exit the worker after a sticky CUDA error")
    sample_device: int | None = Field(
        None,
        ge=0,
        le=1023,
        description="reconcile the pool with this device's real memory (device sampler: one "
        "worker samples, the others stand by); unset: no device truth",
    )
    device_reader: str = Field(
        "auto", description="how the device sampler reads the device: auto, nvml, torch, fake:PATH"
    )
    log_format: Literal["plain", "json"] = Field(
        "plain",
        description="access log lines (logger gpulock.access, one per request): "
        "plain key=value or json",
    )
    history_file: str | None = Field(
        None, description="tests: prefix of per-worker grant/release logs"
    )

    @field_validator("priority_header", "tenant", mode="before")
    @classmethod
    def _no_header(cls, v: object) -> object:
        return None if isinstance(v, str) and v.strip() == "" else v

    @field_validator("keep", mode="before")
    @classmethod
    def _keep(cls, v: Any) -> float:
        # the core's bound (AsyncPool keep=), checked as GpuLimiter(keep=) checks it
        if isinstance(v, str) and v.strip() == "":
            return 0.0
        try:
            return parse_seconds(
                v,
                name="keep",
                minimum=0.1,
                maximum=MAX_KEEP_S,
                allow_zero=True,
            )
        except InvalidArgument as e:
            raise ValueError(f"{e} (0: off, the default)") from None

    @model_validator(mode="after")
    def _priorities(self) -> Settings:
        if self.max_priority is not None and self.max_priority < self.priority:
            raise ValueError(
                f"GPULOCK_MAX_PRIORITY ({self.max_priority}) must not be below "
                f"GPULOCK_PRIORITY ({self.priority})"
            )
        return self

    @field_validator(
        "capacity", "resident", "sleep_bytes", "cpu_resident", "cuda_context", "max_request_bytes"
    )
    @classmethod
    def _size(cls, v: str | None, info):
        if v is None or v == "":
            return None if info.field_name in ("capacity", "resident") else v
        if info.field_name in ("resident", "cuda_context") and str(v).strip() in ("0", "none"):
            return "0"
        parse_size(v, name=info.field_name)
        return v

    def resident_bytes(self) -> int | None:
        """Configured resident bytes: None when unset (measure/default), 0 for none."""
        if self.resident is None:
            return None
        return 0 if self.resident == "0" else parse_size(self.resident, name="resident")
