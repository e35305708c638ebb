"""ServerConfig: how `strata serve` listens, admits and answers (the engine's options apart)."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field

from engine.errors import FlagError
from engine.memory.sizes import MiB
from engine.request.conversation import PROMPT_BYTES_PER_TOKEN
from engine.request.sampler import SamplingParams

API_KEY_ENV = "STRATA_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"


@dataclass(frozen=True)
class ServerConfig:
    """Listening address, the bearer token, every bound on what a client may make the server
    hold (queue, body, prompt text, connections, and how long a connection may take to send
    its request), the names a browser may reach it by, and what a request that leaves a field
    out gets (`strata serve`'s sampling options and --max-new)."""

    model_id: str  # the id /v1/models lists and requests name
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    queue_max: int = 8  # requests waiting behind the running one; past that, 429
    max_body_bytes: int = 8 * MiB
    max_new: int = 256  # max_tokens when a request gives none (cut to what the context holds)
    params: SamplingParams = field(default_factory=SamplingParams)
    max_prompt_bytes: int | None = None  # messages' text; None: PROMPT_BYTES_PER_TOKEN x --ctx
    max_connections: int = 256  # open connections; past it the oldest idle one is closed
    header_timeout_s: float = 10.0  # a request head (line and headers) must arrive within
    body_timeout_s: float = 30.0  # the body must arrive within this once the head is in
    idle_timeout_s: float = 5.0  # a kept-alive connection with no new request is closed
    allowed_hosts: tuple[str, ...] = ()  # Host names beside loopback and --host ('*': any)

    def __post_init__(self) -> None:
        errors = []
        for flag, value in (("--header-timeout", self.header_timeout_s),
                            ("--body-timeout", self.body_timeout_s),
                            ("--idle-timeout", self.idle_timeout_s)):
            if not (math.isfinite(value) and 0 < value <= 3600):
                errors.append(f"{flag} {value:g} must be in (0, 3600] seconds")
        if not 1 <= self.max_connections <= 1_000_000:
            errors.append(f"--max-connections {self.max_connections} must be in 1..1000000")
        if self.max_prompt_bytes is not None and self.max_prompt_bytes < 1024:
            errors.append(f"--max-prompt-kib {self.max_prompt_bytes / 1024:g} must be at least 1")
        for name in self.allowed_hosts:
            if not name or any(c.isspace() or c in "/@" for c in name):
                errors.append(f"--allow-host {name!r} is not a host name; give a name such as "
                              "my-box.local, an address, or '*' for any")
        if not 0 <= self.port <= 65535:
            errors.append(f"--port {self.port} must be in 0..65535 (0: any free port)")
        if self.queue_max < 0:
            errors.append(f"--queue {self.queue_max} must be >= 0 (0: no request waits)")
        if self.max_body_bytes < 1024:
            errors.append(f"--max-body-mib {self.max_body_bytes / MiB:g} must be at least "
                          "0.001 (1 KiB)")
        if self.max_new < 1:
            errors.append(f"--max-new {self.max_new} must be at least 1")
        if self.api_key is not None and not self.api_key.strip():
            errors.append(f"--api-key (or {API_KEY_ENV}) is empty; give a token or leave it out")
        if not self.model_id:
            errors.append("--alias is empty; give the model id clients name")
        if errors:
            raise FlagError(errors)

    def prompt_limit(self, ctx: int) -> int:
        """The largest prompt text (bytes of the messages) a request may send for --ctx."""
        if self.max_prompt_bytes is not None:
            return self.max_prompt_bytes
        return PROMPT_BYTES_PER_TOKEN * ctx

    def host_allowed(self, host: str) -> bool:
        """Whether a request's Host (or Origin's) name is one this server answers to: a
        loopback name, the --host it listens on, or an --allow-host name. A browser page
        from elsewhere that resolves its own name to this machine (DNS rebinding) sends its
        own name, and is refused."""
        names = {*LOOPBACK_NAMES, self.host.lower(), *(n.lower() for n in self.allowed_hosts)}
        return ANY_HOST in names or host.lower().removesuffix(".") in names

    @property
    def loopback(self) -> bool:
        """Whether only this machine can connect (127.0.0.0/8, ::1, localhost)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
