"""Tokenizer of a checkpoint folder: tokenizer.json plus what tokenizer_config.json says about
chat templates and special tokens."""

from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer and its special tokens.

    tokenizer: None when the folder has no tokenizer.json (token-id prompts still work).
    eos_token_ids: every id that ends generation: config.json's and generation_config.json's
        eos_token_id, plus the id of eos_token when the tokenizer knows it.
    """

    tokenizer: Tokenizer | None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


def read_json(path: pathlib.Path) -> dict[str, Any]:
    """A JSON object from a file; ValueError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:  # a ValueError whose message does not name the file
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_optional_json(path: pathlib.Path) -> dict[str, Any]:
    """read_json, or {} when the file does not exist."""
    return read_json(path) if path.is_file() else {}


def eos_ids_of(value: object, source: pathlib.Path) -> set[int]:
    """eos_token_id as found in config files: absent, an int, or a list of ints."""
    if value is None:
        return set()
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return set(value)
    raise ValueError(f"{source}: eos_token_id must be an int or a list of ints, got {value!r}")


def _token_text(value: object) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: pathlib.Path, tok_cfg: dict[str, Any]) -> str | None:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()  # transformers >= 4.5x layout
    return template


def _refuse_sentencepiece_only(folder: pathlib.Path) -> None:
    """A folder with tokenizer.model and no tokenizer.json (many Llama 2, Mistral and Gemma
    repositories) would load with no tokenizer and fail only at the first text prompt.
    Converting a sentencepiece model needs its protobuf schema and the sentencepiece library,
    which jaxserve does not depend on; so refuse here, naming the file and the one-line fix."""
    sp_file = folder / "tokenizer.model"
    if sp_file.is_file() and not (folder / "tokenizer.json").is_file():
        raise ValueError(
            f"{sp_file}: a sentencepiece tokenizer with no tokenizer.json next to it, which "
            "jaxserve cannot load; write tokenizer.json once with transformers "
            "(AutoTokenizer.from_pretrained(folder).save_pretrained(folder)) and load again"
        )


def _warn_eos_outside_vocab(folder: pathlib.Path, sources: dict[str, set[int]]) -> None:
    """One warning naming each eos_token_id (file and key) at or past config.json's
    vocab_size: the model can never sample it, so no request stops on it."""
    vocab_size = read_optional_json(folder / "config.json").get("vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        return
    bad = {src: sorted(i for i in ids if i >= vocab_size) for src, ids in sources.items()}
    bad = {src: ids for src, ids in bad.items() if ids}
    if not bad:
        return
    left = sorted({i for ids in sources.values() for i in ids if i < vocab_size})
    logger.warning(
        "%s outside the vocabulary (vocab_size=%d): no request can stop on %s; %s",
        "; ".join(f"{src}={ids}" for src, ids in bad.items()),
        vocab_size,
        "them" if sum(map(len, bad.values())) > 1 else "it",
        f"EOS stops on {left} only"
        if left
        else "no EOS id is left: requests end at max_tokens, stop or stop_token_ids",
    )


def load_tokenizer(path: str | pathlib.Path) -> TokenizerInfo:
    """Load tokenizer.json (if present) and the special tokens of a checkpoint folder.

    An eos_token_id past config.json's vocab_size is kept (harmless) with one warning on the
    "jaxserve" logger naming the file and key, since no request can stop on it.

    Raises:
        ValueError: a present file is malformed (the file is named); tokenizer.model with no
            tokenizer.json (a sentencepiece-only tokenizer, named: see _refuse_sentencepiece_only).
    """
    folder = pathlib.Path(path)
    _refuse_sentencepiece_only(folder)
    tok_file = folder / "tokenizer.json"
    tokenizer = None
    if tok_file.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises its own Exception type
            raise ValueError(f"{tok_file}: cannot load tokenizer ({e})") from None
    tok_cfg = read_optional_json(folder / "tokenizer_config.json")
    sources = {}  # "file key" -> the EOS ids it names
    for name in ("config.json", "generation_config.json"):
        file = folder / name
        sources[f"{name} eos_token_id"] = eos_ids_of(
            read_optional_json(file).get("eos_token_id"), file
        )
    eos_token = _token_text(tok_cfg.get("eos_token"))
    if tokenizer is not None and eos_token is not None:
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is not None:
            sources[f"tokenizer_config.json eos_token {eos_token!r}"] = {eos_id}
    _warn_eos_outside_vocab(folder, sources)
    eos_ids = set().union(*sources.values())
    return TokenizerInfo(
        tokenizer=tokenizer,
        chat_template=_chat_template(folder, tok_cfg),
        bos_token=_token_text(tok_cfg.get("bos_token")),
        eos_token=eos_token,
        eos_token_ids=frozenset(eos_ids),
    )
