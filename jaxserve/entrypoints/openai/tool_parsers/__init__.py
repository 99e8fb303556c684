"""Tool-call parsers, one module per chat format, chosen with ``--tool-call-parser`` (vLLM's
names): they read tool calls out of a model's text for tool_choice "auto"."""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.base import FunctionCall, ToolParser
from jaxserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from jaxserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,  # Qwen 2.5 / 3 templates write Hermes' <tool_call> blocks
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return parser()


__all__ = ["TOOL_PARSERS", "FunctionCall", "ToolParser", "get_tool_parser"]
