"""What the HTTP server is, apart from the engine: address, API key, limits, uvicorn's knobs.

Host side and light: ``jaxserve serve`` builds one from its flags before fastapi, uvicorn or jax
load, and hands it to ``api_server.run_server`` with the engine's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.entrypoints.openai.body import DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class ServerSettings:
    """The server's settings.

    host, port: where to listen (port 0: any free port).
    api_key: the key the /v1 routes need; None: $JAXSERVE_API_KEY, else no key (an empty one is
        refused by run_server).
    served_model_name: the model name the API shows and requests give; None: the engine's model.
    max_waiting_requests: answer 503 to a request arriving while this many wait; None: no bound.
    max_request_body_bytes: answer 413 to a request body over this many bytes.
    trust_request_chat_template: let requests send their own chat_template.
    tool_call_parser: the format of the model's tool calls (tool_parsers.TOOL_PARSERS), read
        for tool_choice "auto"; None: "auto" is refused.
    uvicorn_log_level, graceful_shutdown_timeout: uvicorn's log level, and how long open
        requests may finish on SIGINT / SIGTERM before they are cut (seconds).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting_requests: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    uvicorn_log_level: str = "info"
    graceful_shutdown_timeout: float = 10.0
