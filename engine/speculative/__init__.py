"""MTP speculative decoding: the draft sources, the draft head, the exact verifier, the
decoder and its drafting policy."""
