"""A structural tag (jaxserve/structural_tag.py) as an llguidance grammar: one
``llguidance.StructTag`` per structure, its trigger the first of the request's triggers that
its ``begin`` starts with (vLLM's guidance backend pairs them the same way).

A trigger written like a token (``<...>``) that is one of llguidance's special tokens (every
added token of the tokenizer, Qwen's ``<tool_call>`` included) is matched as that token: the
model emits it as one id, which free text never allows. Any other trigger is matched in the
text (a lazy lexeme: the tag starts where the text first contains it). vLLM takes every
``<...>`` trigger for a special token, and a tokenizer without one by that name fails to
compile; here such a trigger is text. A request whose ``<...>`` triggers mix special tokens and
text is refused: llguidance's StructTag treats all of them one way.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import llguidance

from jaxserve.structural_tag import parse_structural_tag


def struct_tag_grammar(
    spec: str, special_tokens: Collection[str], json_defaults: dict[str, Any]
) -> str:
    """llguidance's grammar for a canonical structural tag.

    Args:
        spec: check_structural_tag's canonical text.
        special_tokens: llguidance's special tokens of the tokenizer, by their text.
        json_defaults: llguidance's JSON options for each schema (its own "x-guidance" wins).

    Raises:
        ValueError: triggers that mix special tokens and text.
    """
    structures, triggers = parse_structural_tag(spec)
    tags = []
    for s in structures:
        trigger = next(t for t in triggers if s["begin"].startswith(t))
        own = s["schema"].get("x-guidance", {})
        options = {**json_defaults, **own} if isinstance(own, dict) else own
        schema = {**s["schema"], "x-guidance": options}
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema,
                                         end=s["end"]))  # fmt: skip
    token_like = {t.trigger for t in tags if t.trigger.startswith("<") and t.trigger.endswith(">")}
    special = token_like & set(special_tokens)
    if special and special != token_like:
        raise ValueError(
            f"triggers {sorted(special)} are special tokens and {sorted(token_like - special)} "
            "are not: llguidance matches all such triggers one way; give triggers of one kind"
        )
    return llguidance.StructTag.to_grammar(tags, assume_special=bool(special))
