"""`strata serve`: the engine behind an OpenAI-compatible HTTP server until interrupted.

The serve loop is the one `strata run` uses (`--serve` is implied); the loan is as the
STRATA_PREFILL_* variables and the engine options say. Plan, trace and per-request lines go to
stderr as `strata run` prints them. Ctrl+C (or SIGTERM) cancels a running request (its loan
rolls back), ends the event streams, checks the engine and exits.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import threading
from pathlib import Path

from engine.cli.options import (
    add_engine_args,
    add_sampling_args,
    engine_options,
    integer,
    loan_flags,
    number,
    sampling_params,
)
from engine.cli.run import stderr_line
from engine.errors import StrataError
from engine.memory.sizes import MiB, format_mib
from engine.request.conversation import PROMPT_BYTES_PER_TOKEN
from engine.runtime.serve import ServeLoop
from engine.server.config import API_KEY_ENV, ServerConfig
from engine.server.runner import ServerThread
from engine.server.service import Service
from engine.synth.demo import is_model_name
from engine.trace.events import EventBus


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine")
    add_engine_args(p)
    add_sampling_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=integer, default=8080,
                   help="port (default 8080; 0: any free one)")
    g.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: "
                                     f"${API_KEY_ENV} when set)")
    g.add_argument("--alias", help="the model id clients name (default: the --model name, "
                                   "or the file name without .gguf)")
    g.add_argument("--queue", type=integer, default=8,
                   help="requests that may wait behind the running one; past that, 429 with "
                        "Retry-After (default 8)")
    g.add_argument("--max-body-mib", type=number, default=8.0,
                   help="largest request body in MiB (default 8)")
    g.add_argument("--max-prompt-kib", type=number,
                   help="largest text of a request's messages in KiB, refused (413) before "
                        f"any work (default: {PROMPT_BYTES_PER_TOKEN} bytes a token of --ctx)")
    g.add_argument("--max-new", type=integer, default=256,
                   help="max_tokens of a request that gives none, cut to what --ctx holds "
                        "(default 256)")
    b = p.add_argument_group("connections (each bound answers or closes in one line)")
    b.add_argument("--max-connections", type=integer, default=256,
                   help="open connections; past it the one idle longest is closed (default "
                        "256, kept below the open-files limit)")
    b.add_argument("--header-timeout", type=number, default=10.0,
                   help="seconds a connection has to send a request's line and headers "
                        "(default 10)")
    b.add_argument("--body-timeout", type=number, default=30.0,
                   help="seconds a request's body may take once its headers are in; then 408 "
                        "(default 30)")
    b.add_argument("--idle-timeout", type=number, default=5.0,
                   help="seconds a kept-alive connection may wait for its next request "
                        "(default 5)")
    b.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="without an API key, a Host name to answer besides loopback names "
                        "and --host (repeat it; '*': any). Other names are refused (DNS "
                        "rebinding)")
    p.set_defaults(func=serve, serve=True)


def model_id(model: str) -> str:
    """The id a served model is listed under: 'demo' or a preset's name, else the file's."""
    return model if is_model_name(model) else Path(model).stem


def server_config(args: argparse.Namespace) -> ServerConfig:
    kib = args.max_prompt_kib
    return ServerConfig(
        model_id=args.alias if args.alias is not None else model_id(args.model),
        host=args.host, port=args.port,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV),
        queue_max=args.queue, max_body_bytes=_bytes(args.max_body_mib, MiB, "--max-body-mib"),
        max_new=args.max_new, params=sampling_params(args),
        max_prompt_bytes=None if kib is None else _bytes(kib, 1024, "--max-prompt-kib"),
        max_connections=args.max_connections, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, idle_timeout_s=args.idle_timeout,
        allowed_hosts=tuple(args.allow_host),
    )  # fmt: skip


def _bytes(value: float, unit: int, flag: str) -> int:
    """`value` units in bytes; a size past what any machine holds is refused in one line."""
    if not 0 <= value <= 2**40 / unit:
        raise StrataError(f"{flag} {value:g} must be between 0 and {2**40 // unit:,} (1 TiB)")
    return int(value * unit)


def serve(args: argparse.Namespace) -> int:
    config = server_config(args)
    options = engine_options(args)
    flags = loan_flags()
    for w in flags.warnings_for(options):
        stderr_line(f"strata: warning: {w}")
    if not config.loopback and not config.api_key:
        stderr_line(f"strata: warning: --host {config.host} without an API key: anyone who can "
                    f"reach this machine can use the engine; give --api-key or ${API_KEY_ENV} "
                    "(clients that name this machine otherwise need --allow-host NAME)")
    bus = EventBus()
    service = Service(config, bus)
    server = ServerThread(service, config.host, config.port).start()  # 503 'loading' meanwhile
    if server.capped:
        stderr_line(f"strata: warning: --max-connections {config.max_connections} is past what "
                    f"the open-files limit ({server.fd_limit}) leaves; serving at most "
                    f"{server.connections.max_connections} (raise `ulimit -n` for more)")
    try:
        loop = ServeLoop.create(options, flags, bus, on_trace=stderr_line)
        service.attach(loop, on_line=stderr_line)
        gc.collect()
        gc.freeze()
        stop = _stop_on_signals()
        auth = ", bearer token required" if config.api_key else ""
        stderr_line(f"strata serve: listening on {server.url} (model '{config.model_id}', "
                    f"OpenAI API at {server.url}/v1{auth}); Ctrl+C stops")
        while not stop.wait(0.5) and server.alive:
            pass
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl+C: at once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        server.stop()
    return _report(service)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    return stop


def _report(service: Service) -> int:
    """The closing line: requests by outcome, the engine's check, the ledger by region."""
    worker = service.worker
    if worker is None:
        return 0
    rt = worker.loop.rt
    if worker.fault is None:
        try:
            rt.check_integrity()
        except AssertionError as exc:
            worker.fault = str(exc)
    n = worker.outcomes
    regions = ", ".join(f"{r.name} {format_mib(r.used_bytes)} MiB"
                        for r in rt.ledger.snapshot().regions)
    lent = rt.cache.n_lent if rt.cache is not None else 0
    stderr_line(f"strata serve: stopped; requests: {n['completed']} completed, "
                f"{n['cancelled']} cancelled, {n['failed']} failed, "
                f"{service.admission.n_refused} refused with 429; {lent} cache slots lent; "
                f"ledger: {regions}")
    worker.loop.close()  # every byte the engine holds on the device goes back
    if worker.fault is not None:
        raise StrataError(f"the engine's check failed: {worker.fault}")
    return 0
