"""A request body -> the chained hashes of its prompt's first blocks, the key prefix routing
looks up (routing.PrefixAware).

The front has no tokenizer (it loads no model), so a "block" here is a run of the prompt's
text: ``block_chars`` characters of a completion prompt or of a chat conversation rendered
canonically (role, content, a separator per message), or ``block_tokens`` ids of a prompt
given as token ids. Equal prompt prefixes give equal keys in every process (blake2b, not
Python's salted ``hash``), and a multi-turn conversation's keys start with its previous
turn's: turn k + 1 repeats turn k's messages and appends to them. Only full blocks are hashed,
and only the first ``max_blocks``: a routing decision reads a bounded part of the body.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_MESSAGE_END = "\x1e"  # ASCII record separator: cannot end a role by accident


@dataclass(frozen=True)
class PrefixKeyConfig:
    """block_chars: characters per block of a text prompt (~4 per token: 64 ~ 16 tokens).
    block_tokens: ids per block of a token-id prompt.
    max_blocks: blocks hashed per request (the rest of a long prompt is not read)."""

    block_chars: int = 64
    block_tokens: int = 16
    max_blocks: int = 64

    def __post_init__(self) -> None:
        for name in ("block_chars", "block_tokens", "max_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PrefixKeyConfig.{name} must be an int >= 1, got {value!r}")


def prefix_keys(body: Any, config: PrefixKeyConfig) -> list[bytes]:
    """The chained hashes of the first full blocks of ``body``'s prompt (a completion's first
    prompt, or a chat's messages); [] when the body has no prompt the front can read (the
    replica answers a malformed body with its own 400)."""
    if not isinstance(body, dict):
        return []
    if "messages" in body:
        text = _conversation_text(body["messages"])
        return _chain(_blocks(text, config.block_chars, config.max_blocks))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: the first one's blocks
    if isinstance(prompt, str):
        return _chain(_blocks(prompt, config.block_chars, config.max_blocks))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        blocks = _blocks(prompt, config.block_tokens, config.max_blocks)
        return _chain(",".join(map(str, block)) for block in blocks)
    return []


def _conversation_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            break
        parts.append(f"{message.get('role')}\n{_content_text(message.get('content'))}")
        parts.append(_MESSAGE_END)
    return "".join(parts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _blocks(units: Sequence[Any], size: int, max_blocks: int) -> list[Sequence[Any]]:
    num_full = min(len(units) // size, max_blocks)
    return [units[i * size : (i + 1) * size] for i in range(num_full)]


def _chain(blocks: Any) -> list[bytes]:
    keys: list[bytes] = []
    parent = b""
    for block in blocks:
        text = block if isinstance(block, str) else "".join(block)
        parent = hashlib.blake2b(parent + text.encode("utf-8", "surrogatepass"), digest_size=16)
        parent = parent.digest()
        keys.append(parent)
    return keys
