"""What the engine tells: events (frozen dataclasses and a thread-safe bus, the only way out of
the engine), the printed report lines, a request's timing and the prefill's phase clock."""
