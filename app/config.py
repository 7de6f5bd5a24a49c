"""Every knob of vramguard in one place: its default, its doc, where it comes from.

Precedence, highest first: command-line options > environment variables
(``VRAMGUARD_<NAME>``) > the TOML file (``config.toml`` in the per-user config
folder, or the one named by ``--config`` / ``VRAMGUARD_CONFIG``) > defaults.
An unknown key in the file is refused; an unknown ``VRAMGUARD_*`` variable only
warned about (it may be meant for another program), with the closest real name.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import platformdirs
from pydantic import (
    ByteSize,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

APP_NAME = "vramguard"
ENV_PREFIX = "VRAMGUARD_"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # names that reach only this computer
READ_VARIABLES = frozenset({f"{ENV_PREFIX}CONFIG"})
"""``VRAMGUARD_*`` variables read that are not settings."""
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_toml_path: ContextVar[Path | None] = ContextVar("vramguard_toml_path", default=None)


class ConfigError(Exception):
    """A setting has a value vramguard cannot use; the message names the setting."""


def default_config_file() -> Path:
    """The per-user TOML file read when no other is named."""
    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False)) / "config.toml"


def config_file_of(settings: Settings) -> Path | None:
    """The TOML file ``settings`` were read from; None when there was none."""
    return settings._config_file


def config_file_in_use(given: Path | None = None) -> Path:
    """The TOML file settings come from: ``--config``, else VRAMGUARD_CONFIG, else the
    per-user one (which need not exist)."""
    if given is not None:
        return given
    if os.environ.get(f"{ENV_PREFIX}CONFIG"):
        return Path(os.environ[f"{ENV_PREFIX}CONFIG"])
    return default_config_file()


def default_cache_dir() -> Path:
    """The per-user folder for the result cache."""
    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False)) / "results"


def default_models_dir() -> Path:
    """The per-user folder of own models (``vramguard models add``), kept on uninstall
    unless the user asks otherwise."""
    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)) / "models"


def default_gpu_claims_dir() -> Path:
    """Per computer, not per user, so that every user's vramguards see each other on a GPU:
    ProgramData on Windows, /tmp elsewhere."""
    if sys.platform == "win32":
        return Path(os.environ.get("PROGRAMDATA", r"C:\ProgramData")) / APP_NAME / "gpus"
    return Path("/tmp") / f"{APP_NAME}-gpus"


def default_token_file() -> Path:
    """The per-user admin token file, next to the config file."""
    return default_config_file().parent / "admin-token"


class Settings(BaseSettings):
    """All settings. Field descriptions are the user-facing docs (`vramguard serve --help`)."""

    # The TOML file these came from (None: defaults, variables and options only), for
    # the support report; set by `load_settings`.
    _config_file: Path | None = PrivateAttr(None)

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
    )

    host: str = Field("127.0.0.1", description="Address to listen on. Keep 127.0.0.1 "
                      "unless other machines must reach the appliance.")
    port: int = Field(8765, ge=1, le=65535, description="TCP port to listen on.")
    model: str = Field("efficientnet_lite0", description="Model to serve: efficientnet_lite0 "
                       "or a torchvision classifier name such as resnet50.")
    weights: Path | None = Field(None, description="Weights file for a torchvision model "
                                 "(default: torchvision's cache folder).")
    models: list[str] = Field(default_factory=list, description="More models to load at "
                              "start besides --model (comma-separated on the command line); "
                              "any catalogue model also loads when a request asks for it.")
    keep_alive_s: float = Field(300.0, ge=-1, description="Seconds a model that is not the "
                                "--model one stays loaded after its last request (-1: for "
                                "ever, 0: unload when its requests are done). A request's "
                                "keep_alive may only lengthen it, up to max_keep_alive_s "
                                "(with the admin token: any value).")
    max_keep_alive_s: float = Field(3600.0, ge=0, description="The longest stay a request's "
                                    "keep_alive may give a model without the admin token; "
                                    "a longer one is cut to this.")
    min_residency_s: float = Field(30.0, ge=0, description="A model loaded less than this "
                                   "many seconds ago is not unloaded to make room for "
                                   "another (stops endless load/unload cycles).")
    max_loads_per_minute: int = Field(6, ge=1, description="Most model loads in any minute; "
                                      "beyond it a request for a model not loaded gets 503 "
                                      "and a Retry-After.")
    max_loads_per_client_per_minute: int = Field(3, ge=1, description="Most model loads "
                                                 "one client's requests may cause in any "
                                                 "minute (within max_loads_per_minute), so "
                                                 "that one app cannot use up the loads of "
                                                 "the others.")
    models_dir: Path = Field(default_factory=default_models_dir, description="Folder of "
                             "your own models, one sub-folder each (vramguard models add); a "
                             "folder put there by hand is found without a restart.")
    model_check_timeout_s: float = Field(120.0, gt=0, description="Seconds your model's "
                                         "first check (a trial load in a separate process) "
                                         "may take before the folder is refused.")
    profile_dir: Path = Field(default_factory=lambda: default_cache_dir().parent / "profiles",
                              description="Folder of the measured model profiles (reused so "
                              "that a second start skips profiling).")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N.")
    max_batch_size: int = Field(32, ge=1, le=512, description="Largest batch warmup may try.")
    target_latency_ms: float = Field(250.0, gt=0, description="Warmup picks the fastest batch "
                                     "size whose forward pass stays under this.")
    max_wait_ms: float | None = Field(None, ge=0, description="How long a batch may wait for "
                                      "more requests, counted from its first arrival "
                                      "(default: 0 on the CPU, 2 on a GPU).")
    queue_size: int = Field(256, ge=1, description="Requests that may wait for the model; "
                            "beyond this they get 503 and a Retry-After.")
    request_timeout_s: float = Field(10.0, gt=0, description="A request still queued this "
                                     "many seconds after its image arrived gets 503 "
                                     "instead of being computed.")
    max_connections: int = Field(1024, ge=1, description="Connections open at once; a new "
                                 "one beyond this gets 503 and a Retry-After (fewer when the "
                                 "open-files limit is lower).")
    header_timeout_s: float = Field(10.0, gt=0, description="A connection must send a "
                                    "whole request head (the lines before the body) within "
                                    "this many seconds of its start, or of its first byte "
                                    "after an answer; otherwise it is closed.")
    # Longer than common clients' own keep-alive (httpx 5 s, aiohttp 15 s), so that it is
    # the client that closes an idle connection: otherwise a request sent just as the
    # server closes it fails with "server disconnected" (seen in the overload test).
    idle_timeout_s: int = Field(30, ge=1, description="A connection that sends nothing for "
                                "this many whole seconds after an answer is closed.")
    max_body_bytes: ByteSize = Field(ByteSize(32 * 1024**2), gt=0,
                                     description="Largest accepted upload (e.g. 32MiB).")
    max_stream_bytes: ByteSize = Field(ByteSize(2 * 1024**3), gt=0,
                                       description="Largest body of POST "
                                       "/v1/classify/stream, all its images together (e.g. "
                                       "2GiB); each image in it is still held to "
                                       "max_body_bytes.")
    max_inflight_body_bytes: ByteSize = Field(ByteSize(128 * 1024**2), gt=0,
                                              description="Most upload bytes received and "
                                              "held by all requests in progress together; "
                                              "beyond it, 503.")
    max_inflight_body_bytes_per_client: ByteSize = Field(
        ByteSize(64 * 1024**2), gt=0, description="Most upload bytes received and held by "
        "one client's requests in progress; beyond it, 503.")
    body_read_timeout_s: float = Field(10.0, gt=0, description="An upload that sends "
                                       "nothing more for this many seconds gets 408 and "
                                       "its connection is closed.")
    min_upload_bytes_per_s: ByteSize = Field(ByteSize(1024**2), gt=0, description="Slowest "
                                             "an upload may arrive, on average, once its "
                                             "first upload_grace_s have passed (e.g. 1MiB); "
                                             "slower, it gets 408 and its connection is "
                                             "closed. Lower it for clients on slow networks.")
    upload_grace_s: float = Field(5.0, gt=0, description="Seconds every upload gets on top "
                                  "of what min_upload_bytes_per_s allows it (a small one "
                                  "always has this long to arrive).")
    max_image_pixels: int = Field(40_000_000, gt=0, description="Largest accepted image in "
                                  "pixels (width x height); guards against decompression bombs.")
    decode_workers: int | None = Field(None, ge=1, description="Threads that decode images, "
                                       "each with its own decoder process (default: the "
                                       "number of physical CPU cores).")
    decode_cpu_limit_s: float = Field(1.0, gt=0, description="CPU seconds one image may "
                                      "take to open; beyond it its decoder is stopped and "
                                      "the image refused (422).")
    max_image_memory: ByteSize = Field(ByteSize(300 * 1024**2), gt=0, description="Most "
                                       "memory one image may need while it is opened, "
                                       "predicted from its size and format; beyond it, 413.")
    decode_memory_budget: ByteSize = Field(ByteSize(1024**3), gt=0, description="Most "
                                           "memory all images being opened at once may "
                                           "need together; beyond it, 503.")
    cache: bool = Field(True, description="Remember results of images seen before.")
    cache_dir: Path = Field(default_factory=default_cache_dir,
                            description="Folder for the result cache.")
    cache_size: ByteSize = Field(ByteSize(256 * 1024**2), gt=0,
                                 description="Most disk space the result cache may use.")
    log_level: str = Field("info", description="debug, info, warning or error.")
    log_dir: Path = Field(default_factory=lambda: Path(platformdirs.user_log_dir(
        APP_NAME, appauthor=False)), description="Folder of the rotating log files.")
    batch_size: int | None = Field(None, ge=1, description="Use this batch size instead of "
                                   "the one warmup measures as fastest.")
    memory_fraction: float = Field(0.7, gt=0, le=1, description="Share of the device's memory "
                                   "vramguard may plan for (weights and overhead included); "
                                   "shared equally by the vramguards on one GPU.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="How the models compute: fp32; bf16 or fp16 (faster on a GPU "
        "that has them, scores about 0.005 apart); auto: fp32 until a measurement on "
        "the GPU says otherwise.")
    channels_last: bool = Field(False, description="Store images and convolution weights "
                                "in the channels-last layout (faster for some models on "
                                "some GPUs and CPUs; results equal to within rounding).")
    replica_cpus: int | None = Field(None, ge=1, description="Ray Serve only: CPUs each "
                                     "replica reserves (its decoders). Default: 1 on the "
                                     "CPU; beside a GPU, what each GPU of the computer "
                                     "leaves, up to 4.")
    gpu_claims_dir: Path = Field(default_factory=default_gpu_claims_dir, description="Folder, "
                                 "for every user of the computer, where each vramguard on a "
                                 "GPU says so, to share memory_fraction with the others.")
    memory_budget: ByteSize | None = Field(None, gt=0, description="Upper limit on the "
                                           "memory vramguard's models may take together: "
                                           "the weights of every loaded model plus the "
                                           "images in flight (e.g. 2GiB).")
    high_watermark: float = Field(0.9, gt=0, le=1, description="Share of the budget above "
                                  "which vramguard sheds load (batch 1, cache emptied).")
    low_watermark: float = Field(0.75, gt=0, lt=1, description="Share of the budget below "
                                 "which shedding ends.")
    cpu_memory_cap: ByteSize | None = Field(None, gt=0, description="On the CPU: a hard "
                                            "limit on tensor memory that fails like a full "
                                            "GPU (for testing OOM recovery).")
    idle_release_s: float = Field(60.0, ge=0, description="Give cached GPU memory back to "
                                  "other programs after this many idle seconds (0: never, "
                                  "unless the cache is fragmented).")
    large_allocation_bytes: ByteSize = Field(ByteSize(50 * 1024**2), ge=0, description="Log "
                                             "once, with where it was made, any single "
                                             "allocation larger than this that takes a "
                                             "batch beyond the memory measured for it at "
                                             "warmup (0: off).")
    allow_remote: bool = Field(False, description="Allow listening on an address other "
                               "computers can reach (host other than 127.0.0.1/localhost).")
    allowed_hosts: list[str] = Field(default_factory=list, description="Extra host names "
                                     "accepted in the Host header (besides 127.0.0.1, "
                                     "localhost and [::1]).")
    cors_origins: list[str] = Field(default_factory=list, description="Web page origins "
                                    "allowed to call the API (e.g. http://localhost:3000); "
                                    "none by default. Not '*' or 'null'.")
    rate_limit: bool = Field(True, description="Limit how fast each client may send requests.")
    classify_burst: int = Field(100, ge=1, description="Classify requests a client may send "
                                "at once.")
    classify_per_s: float = Field(50.0, gt=0, description="Classify requests per second a "
                                  "client may keep sending.")
    global_burst: int = Field(400, ge=1, description="Classify requests all clients together "
                              "may send at once.")
    global_per_s: float = Field(200.0, gt=0, description="Classify requests per second for "
                                "all clients together.")
    read_burst: int = Field(120, ge=1, description="Read-only requests (stats, memory, "
                                "health) a client may send at once.")
    read_per_s: float = Field(30.0, gt=0, description="Read-only requests per second per "
                              "client.")
    global_read_burst: int = Field(480, ge=1, description="Read-only requests all clients "
                                   "together may send at once (/healthz, /readyz, "
                                   "/v1/events and callers with the admin token are not "
                                   "counted).")
    global_read_per_s: float = Field(120.0, gt=0, description="Read-only requests per "
                                     "second for all clients together.")
    admin_burst: int = Field(10, ge=1, description="Admin requests a client may send at once.")
    admin_per_s: float = Field(1.0, gt=0, description="Admin requests per second per client.")
    global_admin_burst: int = Field(30, ge=1, description="Admin requests without a valid "
                                    "admin token that all clients together may send at once "
                                    "(callers with the token are not counted).")
    global_admin_per_s: float = Field(3.0, gt=0, description="Admin requests without a "
                                      "valid admin token per second for all clients together.")
    token_file: Path = Field(default_factory=default_token_file, description="File holding "
                             "the admin token (created at first start, owner-only).")
    api_key_file: Path | None = Field(None, description="File holding a key that every "
                                      "request except the health checks must send as "
                                      "'Authorization: Bearer KEY' (for a server other "
                                      "computers reach); none: no key asked.")
    redis_url: str | None = Field(None, description="Redis server holding the rate limits "
                                  "shared by several replicas (redis://host:6379/0; cluster "
                                  "only); none: limits kept in this process.")
    redis_prefix: str = Field("vramguard", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                              description="Prefix of every Redis key vramguard writes.")
    redis_timeout_s: float = Field(0.25, gt=0, le=30, description="Cluster only: seconds "
                                   "a replica waits for Redis to connect or reply before it "
                                   "works from its own share of the limits (a hung Redis "
                                   "must not stall requests; a busy machine may need more).")
    replicas: int = Field(1, ge=1, description="Replicas that share the limits (cluster "
                          "only): while Redis cannot be reached, each keeps this share of "
                          "them (the global limits divided by it).")
    replica_port: int = Field(8780, ge=1, le=65535, description="Cluster only: each replica "
                              "serves its own routes (admin calls, /metrics, /v1/events, /ui, "
                              "/v1/memory, /v1/stats) on host, at this port plus its rank on "
                              "its node (0, 1, ...); the proxy serves only the inference "
                              "routes.")

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        value = value.strip().lower()
        if not _DEVICE_RE.match(value):
            raise ValueError("must be auto, cpu, cuda or cuda:N (N a number)")
        return value

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        value = value.strip().lower()
        if value not in {"debug", "info", "warning", "error"}:
            raise ValueError("must be debug, info, warning or error")
        return value

    @field_validator("cors_origins")
    @classmethod
    def _check_cors_origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin.strip() in {"*", "null"}:
                raise ValueError(f"'{origin.strip()}' would let every web page use "
                                 "vramguard; list each page's origin instead, such as "
                                 "http://localhost:3000")
            parts = urlsplit(origin.strip())
            extra = parts.path.strip("/") or parts.query or parts.fragment
            if parts.scheme not in {"http", "https"} or not parts.netloc or extra:
                raise ValueError(f"'{origin}' is not a web page origin: write the scheme, "
                                 "the name and the port only, such as "
                                 "http://localhost:3000")
        return value

    @model_validator(mode="after")
    def _check_watermarks(self) -> Settings:
        if self.low_watermark >= self.high_watermark:
            raise ValueError("low_watermark must be below high_watermark")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = TomlConfigSettingsSource(settings_cls, toml_file=_toml_path.get())
        return (init_settings, env_settings, toml)


def _describe(error: ErrorDetails, config_file: Path | None) -> str:
    name = ".".join(str(part) for part in error["loc"])
    where = f" or in {config_file}" if config_file else ""
    if not name:
        return f"invalid settings: {error['msg'].removeprefix('Value error, ')}"
    if error["type"] == "extra_forbidden":
        return f"unknown setting '{name}' in {config_file}: check its spelling"
    return (f"setting '{name}' (given as an option, as {ENV_PREFIX}{name.upper()}{where}) "
            f"is invalid: {error['msg']}; got {error.get('input')!r}")


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from all sources; raise ConfigError naming any bad setting.

    ``overrides`` are the command-line values (None means "not given").
    """
    path = config_file_in_use(config_file)
    if path != default_config_file() and not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    in_use = path if path.is_file() else None
    token = _toml_path.set(in_use)
    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        settings = Settings(**given)
        settings._config_file = in_use
        return settings
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(e, in_use) for e in exc.errors())) from None
    except ValueError as exc:  # malformed TOML
        raise ConfigError(f"cannot read config file {path}: {exc}. Fix that line, or move "
                          "the file away to start with the defaults.") from None
    except OSError as exc:  # unreadable: permissions, a folder in its place
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}. Make it "
                          "readable, or move it away to start with the defaults.") from None
    finally:
        _toml_path.reset(token)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``VRAMGUARD_*`` variable that is no setting (the settings
    ignore it: a misspelt one would be lost in silence), naming the closest real one."""
    known = sorted({name.upper() for name in Settings.model_fields}
                   | {name.removeprefix(ENV_PREFIX) for name in READ_VARIABLES})
    warnings = []
    for variable in sorted(environ):
        spelt = variable.upper()  # the settings read their variables in any case
        if not spelt.startswith(ENV_PREFIX) or spelt.removeprefix(ENV_PREFIX) in known:
            continue
        closest = difflib.get_close_matches(spelt.removeprefix(ENV_PREFIX), known, n=1)
        hint = f" Did you mean {ENV_PREFIX}{closest[0]}?" if closest else ""
        warnings.append(f"The environment variable {variable} is not a vramguard setting, "
                        f"so it changes nothing.{hint}")
    return warnings
