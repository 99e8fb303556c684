"""``jaxserve serve``: the OpenAI-compatible HTTP server (entrypoints/openai/api_server.py).

    jaxserve serve --model M [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                   [--served-model-name NAME] [--max-waiting-requests N] [engine flags]
                   [--data-parallel-size N [--routing load|prefix|round_robin]]

Serves /v1/models, /v1/completions, /v1/chat/completions, /health and /metrics. The API key is
--api-key, else $JAXSERVE_API_KEY; without either the server needs none. The engine flags are
``jaxserve generate``'s (flags.py). Exit status: 0 after a clean shutdown (SIGINT or
SIGTERM), 2 bad input (a flag, an empty --api-key, a port in use, a model that cannot be found
or read), 130 interrupted before the server started (cli.main). The port is bound first, so a
port in use is reported before the model loads.

With ``--data-parallel-size N`` (N > 1) the command is a front (jaxserve/fleet/): it starts N
``jaxserve serve`` replicas on 127.0.0.1, each on its share of the cores or GPUs, and serves
them behind one endpoint, routing each request by ``--routing``.
"""

from __future__ import annotations

import argparse

from jaxserve.cli.flags import (
    add_engine_flags,
    add_model_flag,
    engine_argv,
    engine_kwargs,
    fail,
    log_to_stderr,
    port,
    positive_float,
    positive_int,
)
from jaxserve.entrypoints.openai.body import DEFAULT_MAX_BODY_BYTES
from jaxserve.entrypoints.openai.settings import ServerSettings
from jaxserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from jaxserve.fleet.front_watch import exit_with_front

TOOL_PARSER_NAMES = sorted(TOOL_PARSERS)

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve serve``."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/models, "
        "/v1/completions, /v1/chat/completions (streaming included), /health and /metrics "
        "(Prometheus). Exit status: 0 after a clean shutdown, 2 bad input.",
    )
    p.set_defaults(run=run)
    add_model_flag(p, required=True)
    _add_http_flags(p)
    _add_chat_flags(p)
    _add_data_parallel_flags(p)
    add_engine_flags(p)


def _add_data_parallel_flags(p: argparse.ArgumentParser) -> None:
    """N engine replicas behind this endpoint (jaxserve/fleet/)."""
    from jaxserve.fleet.routing import ROUTING_POLICIES

    g = p.add_argument_group("data parallel")
    g.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="engine replicas, each a process on its share of the devices (CPU: of the cores) "
        "behind this one endpoint (default 1: this process is the engine)",
    )
    g.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="load",
        help="how a request picks its replica: load (fewest open and waiting requests, then "
        "KV usage; default), prefix (the replica holding its longest prompt prefix, by "
        "consistent hashing of its first blocks, rebalanced off an overloaded one), "
        "round_robin",
    )


def _add_http_flags(p: argparse.ArgumentParser) -> None:
    """Where and how the server listens, and its limits on requests."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port", type=port, default=8000, help="port to listen on (default 8000; 0: any free)"
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on the /v1 routes (default: $JAXSERVE_API_KEY; "
        "neither set: no key)",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name the API shows and requests give (default: --model)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        metavar="N",
        help="answer 503 to a request arriving while N requests already wait (default: no limit)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        choices=_LOG_LEVELS,
        default="info",
        help="uvicorn's log level (default info)",
    )
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGINT / SIGTERM, how long open requests may finish before they are cut "
        "(default 10)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help=f"answer 413 to a request body over N bytes (default {DEFAULT_MAX_BODY_BYTES})",
    )


def _add_chat_flags(p: argparse.ArgumentParser) -> None:
    """What chat requests may bring: their own template, tool calls."""
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests send their own chat_template (a jinja2 program run in a bounded "
        "sandbox); without it such a request is refused with 400, as in vLLM",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSER_NAMES,
        default=None,
        help="the model's tool-call format, read for tool_choice 'auto' (vLLM's names); "
        "without it 'auto' is refused, 'required' and named functions work",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``jaxserve serve``: 0 after a clean shutdown, 2 bad input."""
    log_to_stderr()
    # fastapi, uvicorn and jax load here, not for --help or a bad flag.
    from jaxserve.entrypoints.openai.api_server import run_server

    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        uvicorn_log_level=args.uvicorn_log_level,
        graceful_shutdown_timeout=args.graceful_shutdown_timeout,
    )
    if args.data_parallel_size > 1:
        return _run_data_parallel(args, settings)
    try:
        exit_with_front()  # a data-parallel replica: it exits when its front is gone
        return run_server({"model": args.model, **engine_kwargs(args)}, settings)
    except (OSError, TypeError, ValueError) as e:  # bad model or flag, a port that is taken
        return fail("serve", str(e))


def _run_data_parallel(args: argparse.Namespace, settings: ServerSettings) -> int:
    from jaxserve.fleet.data_parallel import DataParallelConfig, run_data_parallel

    try:
        config = DataParallelConfig(
            num_replicas=args.data_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size or 1,
            routing=args.routing,
        )
        return run_data_parallel(replica_args(args), config, settings)
    except (OSError, ValueError, RuntimeError) as e:  # bad flag, port taken, a replica failed
        return fail("serve", str(e))


def replica_args(args: argparse.Namespace) -> list[str]:
    """One replica's ``jaxserve serve`` flags: the model, the engine and the per-request
    settings of this command (not its address, key or data-parallel flags: the front's)."""
    argv = ["--model", args.model, "--served-model-name", args.served_model_name or args.model]
    if args.max_waiting_requests is not None:
        argv += ["--max-waiting-requests", str(args.max_waiting_requests)]
    argv += ["--max-request-body-bytes", str(args.max_request_body_bytes)]
    argv += ["--uvicorn-log-level", args.uvicorn_log_level]
    argv += ["--graceful-shutdown-timeout", str(args.graceful_shutdown_timeout)]
    if args.trust_request_chat_template:
        argv.append("--trust-request-chat-template")
    if args.tool_call_parser:
        argv += ["--tool-call-parser", args.tool_call_parser]
    return argv + engine_argv(args)
