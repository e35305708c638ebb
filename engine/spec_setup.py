"""Wiring of MTP speculative decoding into a runtime (filled in when MTP lands)."""
