"""Device memory: `sizes` (parse/format bytes), `ledger` (regions x segments), `planner` (pure
startup and loan plans), `ring` (the prompt path's staging ring and its size rule), `costs`
(device bytes of every planned item, prefill FLOPs).

Import from the modules; this package re-exports nothing, so its modules can import each other
and `engine.experts` without cycles.
"""
