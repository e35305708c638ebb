"""Routed experts on the device: `host` (host bytes per expert), `residency` (the table of which
slot holds which expert), `cache` (fill, lend, refill), `profile` (the fill order file).

Import from the modules; this package re-exports nothing (see `engine.memory`).
"""
