"""``jaxserve router``: the front of disaggregated serving (jaxserve/fleet/disagg.py).

    jaxserve router --prefill URL [URL ...] --decode URL [URL ...] [--host 127.0.0.1]
                    [--port 8000] [--api-key KEY] [--pass-kv-transfer-params]

Each completion or chat request is prefilled (``max_tokens`` 1) on the least loaded --prefill
server, then decoded on the least loaded --decode server, whose answer is streamed back. The
servers are ``jaxserve serve`` processes (or any OpenAI-compatible ones). Exit status: 0 after a
clean shutdown (SIGINT or SIGTERM), 2 bad input (a flag, a URL, a port in use).
"""

from __future__ import annotations

import argparse

from jaxserve.cli.flags import fail, log_to_stderr, port, positive_int
from jaxserve.entrypoints.openai.body import DEFAULT_MAX_BODY_BYTES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve router``."""
    p = subparsers.add_parser(
        "router",
        help="route requests' prefill and decode to separate servers (disaggregated serving)",
        description="One OpenAI endpoint over prefill and decode servers: each request is "
        "prefilled on one, decoded on another. Exit status: 0 after a clean shutdown, 2 bad "
        "input.",
    )
    p.set_defaults(run=run)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill (producer) servers, e.g. http://127.0.0.1:8100")  # fmt: skip
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode (consumer) servers")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' (default: $JAXSERVE_API_KEY)"
    )
    p.add_argument(
        "--pass-kv-transfer-params",
        action="store_true",
        help="send vLLM's kv_transfer_params to the servers (all of them need a KV connector): "
        "a decode server then knows the KV its prefill stored and applies its "
        "kv_load_failure_policy when it is missing; without it, it still finds the blocks by "
        "their prefix hash and computes what it does not find",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help=f"answer 413 to a request body over N bytes (default {DEFAULT_MAX_BODY_BYTES})",
    )
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run ``jaxserve router``: 0 after a clean shutdown, 2 bad input."""
    log_to_stderr()
    from jaxserve.entrypoints.openai.listen import api_key_of
    from jaxserve.fleet.disagg import build_router_app, router_pools
    from jaxserve.fleet.serve_front import serve_front

    try:
        api_key = api_key_of(args.api_key)
        prefill, decode = router_pools(args.prefill, args.decode)
        app = build_router_app(
            prefill,
            decode,
            api_key=api_key,
            max_body_bytes=args.max_request_body_bytes,
            pass_kv_transfer_params=args.pass_kv_transfer_params,
        )
        what = f"routing prefill {args.prefill} -> decode {args.decode}"
        return serve_front(app, args.host, args.port, args.uvicorn_log_level, what, api_key)
    except (OSError, ValueError) as e:
        return fail("router", str(e))
