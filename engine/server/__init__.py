"""The OpenAI-compatible HTTP server behind `strata serve`: Starlette on uvicorn.

Requests run one at a time through the serve loop (the loan needs the whole engine); the rest
wait in a bounded queue. Every input is bounded: connections (`connections`: a head deadline,
a cap below the open-files limit), bodies and prompts (`service`, `schema`: 413/408/400 before
any work), and, without an API key, what a web page may make it do (`origin`). `codec` (events, flags and the ledger as JSON) imports neither
Starlette nor uvicorn, so the app's remote link can use it alone.
"""
