"""The daemon's configuration: one pydantic model, filled from the command line or a test.

Invariant: a DaemonConfig that validated can build an EngineConfig (``engine_config()``)
and a server; ranges are checked here so a bad flag fails before the model loads.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagefleet.api.body_budget import DEFAULT_MAX_INFLIGHT_BODY_MB
from pagefleet.api.limits import DEFAULT_MAX_BODY_BYTES
from pagefleet.api.model_names import default_served_model_name
from pagefleet.api.openai import ToolCallParser
from pagefleet.engine.config import EngineConfig

Role = Literal["unified", "prefill", "decode"]

# The chunked-prefill default of daemons (the engine's own default stays 0 = one step).
DEFAULT_LONG_PREFILL_TOKENS = 256
# The step token budget of unified and prefill daemons (a prompt's chunk plus decodes).
DEFAULT_MAX_BATCHED_TOKENS = 2048
# A decode daemon's budget per running-sequence slot: one token for each stream it decodes
# plus as many again for prompts joining (its own short prefills, the last token of an
# imported prompt). With 2048 a decode pod prefilled every new chat prompt of a turnover
# in one 100-250 ms step that stalled all its streams (docs/benchmarks.md, P/D session 6);
# 2 x max_num_seqs (128 at 64) let them in a few at a time.
DECODE_TOKENS_PER_SEQ = 2
# The devices the engine has kernels and a KV pool for.
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


class DaemonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = "tiny"
    served_model_name: str | None = None  # default: default_served_model_name(model)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    role: Role = "unified"
    redis_url: str | None = None
    # Also publish KV events in vLLM's ZeroMQ format on this bound endpoint (e.g.
    # tcp://*:5557), for routers that read vLLM's events (kvindex/zmq_events.py).
    kv_events_zmq: str | None = None
    kv_events_zmq_replay: str | None = None  # ROUTER endpoint serving recent events again
    kv_namespace: str = ""  # default: the served model name
    pod_name: str | None = None  # default: $POD_NAME, else hostname:port
    block_size: int = Field(default=16, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    # Token budget of one engine step; None: the role's default (``step_token_budget``).
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    # Most prompt tokens one request prefills per step (0: the whole step budget). A
    # one-step 1200-token prefill on a CPU holds every request that arrives meanwhile for
    # up to ~1.8 s (bench/routing.py's per-request breakdown, docs/benchmarks.md session
    # 5); chunks of 256 let them in at the next chunk, and the scheduler keeps a prompt
    # that shares the blocks still being computed waiting for them (no double prefill).
    long_prefill_token_threshold: int = Field(default=DEFAULT_LONG_PREFILL_TOKENS, ge=0)
    max_model_len: int | None = Field(default=None, ge=2)
    kv_cache_memory_mb: int = Field(default=256, ge=1)
    num_gpu_blocks: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    enable_prefix_caching: bool = True
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    attention_backend: str | None = None
    # How many requests may wait beyond the running batch before new ones get 429.
    max_queue: int = Field(default=256, ge=0)
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    # Request bodies held at once (api/body_budget.py): past it, a 503 before the body is
    # read. Admission counts requests only after their bodies are read and parsed, so 256
    # clients sending 4 MiB each made this process hold 1.3 GB, every one of them a 400.
    max_inflight_body_mb: int = Field(default=DEFAULT_MAX_INFLIGHT_BODY_MB, ge=1)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # Clients reached directly (no gateway in front, or a router without such timeouts),
    # as the gateway's flags of the same names. The longest one write may wait for a client
    # to take bytes (it stopped reading): past it the connection is cut and the request's
    # sequences aborted, so a stalled reader holds neither blocks nor a slot.
    client_write_timeout_s: float = Field(default=30.0, gt=0)
    # A stream whose client is this far behind (bytes of SSE made but not yet taken by the
    # socket) is aborted: a batch engine cannot pause one sequence, and without a bound the
    # daemon held a slow reader's whole output (n x logprobs: tens of MB) in memory.
    max_stream_backlog_mb: int = Field(default=64, ge=1)
    # From a request's headers to the last byte of its body (then a 408).
    body_timeout_s: float = Field(default=30.0, gt=0)
    # An idle connection, or one still sending its headers (slowloris), is closed after
    # this long (aiohttp's default, 3630 s, let each hold a socket for an hour).
    keepalive_timeout_s: float = Field(default=75.0, gt=0)
    heartbeat_s: float = Field(default=1.0, gt=0)
    heartbeat_ttl_s: float = Field(default=5.0, gt=0)
    log_level: str = "warning"
    # What this replica costs per hour, in dollars: /metrics then reports cost per token.
    cost_per_hour: float = Field(default=0.0, ge=0)
    # P/D: how long a prefill pod keeps a finished prompt's KV for a decode pod to pull,
    # how long a decode pod waits for one pull, and the address it is pulled from.
    kv_transfer_timeout_s: float = Field(default=30.0, gt=0)
    kv_pull_timeout_s: float = Field(default=10.0, gt=0)
    kv_advertise_host: str | None = None  # default: $POD_IP, else --host unless a wildcard
    # Where pulled/exported KV is staged in shared memory between the HTTP process and the
    # engine process (a tmpfs); "" sends the bytes through the engine pipe instead.
    kv_stage_dir: str = "/dev/shm"
    # Run the engine in its own process (engine_core.py), so the HTTP layer never takes
    # the GIL from the model; off: an engine thread in the HTTP process.
    engine_process: bool = True
    # An engine process that has work but sends nothing (no step, no reply) for this long
    # is hung (stopped, deadlocked, a step that never ends): it is killed and the daemon
    # exits non-zero. 0: never. Generous by default: a long prefill on a CPU can take
    # seconds, and a false positive restarts the pod.
    engine_hang_timeout_s: float = Field(default=60.0, ge=0)
    # Decode steps replayed from CUDA graphs (EngineConfig.cuda_graphs; CUDA + Triton only).
    cuda_graphs: bool = False
    # One JSON line per finished prompt with its timings (request_log.py); None: off.
    request_log: str | None = None
    # With tool_choice "auto", read the calls the model writes in this format out of its
    # text into message.tool_calls (tool_calls.py; vLLM's --tool-call-parser); "none":
    # the text is the content, as written.
    tool_call_parser: ToolCallParser = "none"

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        # Checked here, before the engine process starts and loads the model: an unknown
        # device used to fail there with torch's list of 20 device types, none of which
        # (but cpu and cuda) pagefleet runs on.
        if not DEVICE_PATTERN.fullmatch(value):
            raise ValueError(f"pagefleet runs on cpu or cuda (cuda:N for one GPU), not {value!r}")
        return value

    @model_validator(mode="after")
    def _budget_serves_every_stream(self) -> DaemonConfig:
        if self.step_token_budget < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.step_token_budget}) is below max_num_seqs "
                f"({self.max_num_seqs}): running streams would go without a token in a step; "
                "raise the budget or lower max_num_seqs"
            )
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or default_served_model_name(self.model)

    @property
    def namespace(self) -> str:
        return self.kv_namespace or self.model_name

    @property
    def pod(self) -> str:
        return self.pod_name or os.environ.get("POD_NAME") or f"{socket.gethostname()}:{self.port}"

    @property
    def advertise_host(self) -> str:
        """Where decode pods reach this pod's KV pull endpoint."""
        if self.kv_advertise_host:
            return self.kv_advertise_host
        if os.environ.get("POD_IP"):
            return os.environ["POD_IP"]
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def step_token_budget(self) -> int:
        """The engine's ``max_num_batched_tokens``: the flag when given, else 2048, or on a
        decode daemon 2 x ``max_num_seqs``. A decode budget is never below
        ``max_num_seqs``, and the scheduler leaves one token to every running decode
        before prefill chunks take the rest, so no running stream goes without its token."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.role == "decode":
            return DECODE_TOKENS_PER_SEQ * self.max_num_seqs
        return DEFAULT_MAX_BATCHED_TOKENS

    @property
    def max_inflight(self) -> int:
        """Requests admitted at once: the running batch plus the bounded waiting queue."""
        return self.max_num_seqs + self.max_queue

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_mb << 20,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.step_token_budget,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_namespace=self.namespace,
            kv_transfer_timeout_s=self.kv_transfer_timeout_s,
            cuda_graphs=self.cuda_graphs,
        )
