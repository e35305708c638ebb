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


class TextTooLongError(StrataError):
    """Text with more bytes than a prompt of --ctx tokens can hold, refused before the chat
    template or the tokenizer sees it (`engine.request.conversation.check_text_fits`)."""


class ContextFullError(StrataError):
    """A prompt that leaves no room in --ctx to answer, refused before anything is read.
    `n_message`: the new message's own tokens when known (the rest is the conversation and
    its template); `fits_alone`: a new conversation would hold the message."""

    def __init__(self, n_prompt: int, ctx: int, n_message: int | None = None,
                 fits_alone: bool = False):
        self.n_prompt, self.ctx, self.n_message = n_prompt, ctx, n_message
        self.fits_alone = fits_alone
        super().__init__(f"{self.numbers}: no room left to answer; {self.remedy}")

    @property
    def n_conversation(self) -> int:
        """The prompt's tokens besides the message: earlier messages and the template."""
        return self.n_prompt - (self.n_message or 0)

    @property
    def numbers(self) -> str:
        """'12,345 tokens + 6,269 in the conversation = 18,614 >= --ctx 16,384'."""
        if self.n_message is None:
            return f"the prompt is {self.n_prompt:,} tokens >= --ctx {self.ctx:,}"
        return (f"{self.n_message:,} tokens + {self.n_conversation:,} in the conversation = "
                f"{self.n_prompt:,} >= --ctx {self.ctx:,}")

    @property
    def remedy(self) -> str:
        if self.fits_alone:
            return "start a new conversation, shorten the message or raise --ctx"
        return "shorten the message or raise --ctx"
