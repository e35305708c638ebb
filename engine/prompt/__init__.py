"""The prompt path: chunked prefill through the staging ring, its buffers carved from lent
cache-tail slots or the owned prompt regions, and the lent range it gives back."""
