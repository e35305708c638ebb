"""ServerConfig: how `strata serve` listens, admits and answers (the engine's options apart)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from engine.errors import FlagError
from engine.memory.sizes import MiB
from engine.sampler import SamplingParams

API_KEY_ENV = "STRATA_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    """Listening address, the bearer token, the queue bound, the body limit, and what a
    request that leaves a field out gets (`strata serve`'s sampling options and --max-new)."""

    model_id: str  # the id /v1/models lists and requests name
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    queue_max: int = 8  # requests waiting behind the running one; past that, 429
    max_body_bytes: int = 8 * MiB
    max_new: int = 256  # max_tokens when a request gives none (cut to what the context holds)
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        errors = []
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

    @property
    def loopback(self) -> bool:
        """Whether only this machine can connect (127.0.0.0/8, ::1, localhost)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
