"""The OpenAI-compatible HTTP server behind `strata serve`: Starlette on uvicorn.

Requests run one at a time through the serve loop (the loan needs the whole engine); the rest
wait in a bounded queue. `codec` (events, flags and the ledger as JSON) imports neither
Starlette nor uvicorn, so the app's remote link can use it alone.
"""
