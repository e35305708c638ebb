"""One request: the `Request` record and its progress sink, the session (KV + tokens of a
sequence), the sampler, stop strings, and a chat's conversation."""
