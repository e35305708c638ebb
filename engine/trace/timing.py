"""Timing: one request's figures behind the timing line (DESIGN §8), in seconds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Timing:
    """Per-request figures behind the timing line (DESIGN §8)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    fresh_tokens: int = 0
    prefill_s: float = 0.0
    generated: int = 0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    drafts_offered: int = 0
    drafts_accepted: int = 0
    bytes_streamed: int = 0
    accepted_hist: dict[int, int] = field(default_factory=dict)
    decode_hits: int = 0  # routed experts the decode steps found in the expert cache
    decode_misses: int = 0  # ... and read from host memory (streamed, or decoded on the CPU)
    decode_promoted: int = 0  # ... missed, then put into the cache (--cache-policy adaptive)
    decode_bytes: int = 0  # ... the misses' bytes over the host-to-device link
    spec_steps: int = 0  # speculative decoding: verify steps, and how many of them drafted
    drafted_steps: int = 0
    forecast_s: float = 0.0  # the prefill's forecast made before it ran (engine.loan.forecast)
    # a prefill stopped by a cancel or a failure: the fresh tokens it read (whole chunks) in
    # `prefill_s`; None: it read them all
    read_tokens: int | None = None

    @property
    def n_read(self) -> int:
        """Fresh tokens the prefill read: all of them unless it was stopped."""
        return self.fresh_tokens if self.read_tokens is None else self.read_tokens

    @property
    def pp_tok_s(self) -> float:
        return self.n_read / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_hit_pct(self) -> float:
        """Share of the decode steps' routed experts found in the expert cache (0: none read)."""
        n = self.decode_hits + self.decode_misses
        return 100.0 * self.decode_hits / n if n else 0.0

    @property
    def decoded(self) -> bool:
        """Whether a decode step ran: the first token is sampled from the prompt's logits, so
        only a second generated token needs one. Without a step there is no TG to report."""
        return self.generated > 1

    @property
    def tg_tok_s(self) -> float:
        """Generated tokens per second of decoding; 0.0 when no decode step ran."""
        return self.generated / self.decode_s if self.decoded and self.decode_s > 0 else 0.0

    def line(self) -> str:
        """The per-request line (DESIGN §8); TG is left out when no decode step ran."""
        generated = (
            f"{self.generated} generated in {self.decode_s * 1e3:.0f} ms "
            f"({self.tg_tok_s:.1f} tok/s)" if self.decoded
            else f"{self.generated} generated (no decode step)"
        )
        read = (f"{self.fresh_tokens} read" if self.read_tokens is None
                else f"{self.fresh_tokens} fresh, {self.read_tokens} read before it stopped")
        return (
            f"strata serve: prompt {self.prompt_tokens} tokens = {self.reused_tokens} reused + "
            f"{read} in {self.prefill_s * 1e3:.0f} ms "
            f"({self.pp_tok_s:.1f} tok/s), {generated}, "
            f"drafts accepted {self.drafts_accepted} of {self.drafts_offered}"
            + (f" ({self.drafted_steps} of {self.spec_steps} steps drafted)"
               if self.spec_steps else "")
        )
