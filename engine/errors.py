"""Typed errors for bad input. Each message is one line naming what was wrong and what to do.

Asserts are for our own bugs; these are for the user's files, flags and devices.
"""


class StrataError(Exception):
    """Base class: the CLI prints `strata: error: <message>` and exits with code 2."""


class GGUFError(StrataError):
    """A GGUF file cannot be used (bad magic, truncated, unsupported architecture or quant...)."""


class ModelError(StrataError):
    """A model's shapes or hyper-parameters are inconsistent or unsupported."""


class TokenizerError(StrataError):
    """The tokenizer metadata or a chat template cannot be used."""


class FlagError(StrataError):
    """Options or STRATA_PREFILL_* flags are invalid or form a refused combination."""

    def __init__(self, violations: list[str] | str):
        self.violations = [violations] if isinstance(violations, str) else list(violations)
        super().__init__("; ".join(self.violations))


class PlanError(StrataError):
    """The memory plan does not fit the device; carries the shortfall table."""

    def __init__(self, message: str, table: str = ""):
        self.table = table
        super().__init__(message)


class DeviceError(StrataError):
    """The requested device does not exist or cannot be used."""


class TokenGraphError(DeviceError):
    """The decode step could not be captured as a CUDA graph; the engine runs it eagerly."""


class LedgerError(StrataError):
    """A reservation does not fit the device budget."""
