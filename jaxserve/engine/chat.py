"""Chat templates: messages -> prompt text, rendered the way Hugging Face transformers does.

Chat templates ship inside checkpoints (``tokenizer_config.json`` or ``chat_template.jinja``), so
they are untrusted code: they run in jinja2's ImmutableSandboxedEnvironment with transformers'
settings (trim_blocks, lstrip_blocks, loop controls, the ``{% generation %}`` tag) and helpers
(``raise_exception``, ``strftime_now``, a non-HTML-escaping ``tojson``), so that a template renders
here exactly as ``tokenizer.apply_chat_template(..., tokenize=False)`` renders it.

Finding a checkpoint's template is checkpoints_tools.tokenizer.load_tokenizer's job (it reads
``tokenizer_config.json`` and ``chat_template.jinja``). A model without a template gets no silent
default: LLM.chat raises ``missing_chat_template_error`` unless the caller passes a template, for
instance ``CHATML_CHAT_TEMPLATE``.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML (Qwen, many fine-tunes). Offered for models without a template; never applied implicitly.
CHATML_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant turns with it (to
    build training masks); rendering only needs the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes '<', '>' and '&', which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict`` for templates without the class itself, whose attributes lead out of the
    sandbox (transformers hardens the same way)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed names, which reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed names on a namespace: {name!r}"
            )


# Bounds on one rendering, trusted template or not: a template is a program, and nested loops
# (``range`` alone allows 100k items a loop in the sandbox) could hold a thread for hours.
MAX_TEMPLATE_LOOP_ITERATIONS = 100_000
MAX_TEMPLATE_OUTPUT_CHARS = 64 * 1024 * 1024
_TICK = "jaxserve_loop_tick"  # the context name of the per-rendering iteration counter


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with a call to the rendering's iteration counter at the head of every
    ``{% for %}`` body, so that a template's loops share one budget, and ``*`` / ``**`` checked
    before they run (``'x' * 10**12`` would allocate a terabyte at once)."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise jinja2.exceptions.SecurityError(f"exponent {right} is too large (max 64)")
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    if len(seq) * times > MAX_TEMPLATE_OUTPUT_CHARS:
                        raise jinja2.exceptions.SecurityError(
                            f"a repetition of {len(seq)} items {times} times is over "
                            f"MAX_TEMPLATE_OUTPUT_CHARS ({MAX_TEMPLATE_OUTPUT_CHARS})"
                        )
        return super().call_binop(context, operator, left, right)

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            tick = jinja2.nodes.Call(jinja2.nodes.Name(_TICK, "load"), [], [], None, None)
            loop.body.insert(0, jinja2.nodes.ExprStmt(tick))
        return tree


def _loop_budget(limit: int) -> Any:
    count = 0

    def tick() -> str:
        nonlocal count
        count += 1
        if count > limit:
            raise jinja2.exceptions.TemplateError(
                f"the chat template ran more than {limit} loop iterations "
                f"(MAX_TEMPLATE_LOOP_ITERATIONS); it was stopped"
            )
        return ""

    return tick


@functools.lru_cache(maxsize=32)
def _compile(chat_template: str) -> jinja2.Template:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(chat_template)


def _validate_messages(messages: object) -> None:
    if not isinstance(messages, list):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must hold at least one message, got []")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}] has no {key!r}: {message!r}")
            if not isinstance(message[key], str):
                raise TypeError(
                    f"messages[{i}][{key!r}] must be a str, got {type(message[key]).__name__}"
                )
        if not message["role"]:
            raise ValueError(f"messages[{i}]['role'] must not be empty")


def render_chat(
    messages: list[dict],
    chat_template: str,
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict] | None = None,
) -> str:
    """Render a conversation to prompt text with a Hugging Face chat template.

    Args:
        messages: the conversation, each a dict with a str ``role`` and a str ``content`` (other
            keys, e.g. ``name``, are passed to the template untouched).
        chat_template: the jinja2 template source.
        add_generation_prompt: end with the header of an assistant turn, so that the model
            answers (the template decides what that header is).
        bos_token, eos_token: the tokenizer's special tokens, as templates read them.
        tools: JSON schemas of tools, for templates that describe tools to the model.

    Returns:
        The prompt text, equal to transformers'
        ``apply_chat_template(messages, tokenize=False, ...)`` with the same arguments. It may
        begin with the BOS token's text: tokenize it without adding special tokens again.

    Raises:
        TypeError / ValueError: malformed messages or tools (naming the index and the field).
        jinja2.TemplateError: the template does not parse, rejects the conversation through
            ``raise_exception``, or passes MAX_TEMPLATE_LOOP_ITERATIONS loop iterations or
            MAX_TEMPLATE_OUTPUT_CHARS characters of output.
    """
    _validate_messages(messages)
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise TypeError(f"tools must be a list of dicts (JSON schemas), got {tools!r}")
    # As transformers does: keys set to None (OpenAI-style "tool_calls": None) are dropped, and
    # the template gets copies it cannot mutate the caller's messages through.
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    chunks = _compile(chat_template).generate(
        messages=messages,
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **{_TICK: _loop_budget(MAX_TEMPLATE_LOOP_ITERATIONS)},
    )
    return _bounded_join(chunks, MAX_TEMPLATE_OUTPUT_CHARS)


def _bounded_join(chunks: Any, limit: int) -> str:
    out: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise jinja2.exceptions.TemplateError(
                f"the chat template wrote more than {limit} characters "
                f"(MAX_TEMPLATE_OUTPUT_CHARS); it was stopped"
            )
        out.append(chunk)
    return "".join(out)


def missing_chat_template_error(model: str) -> ValueError:
    """The error LLM.chat raises for a model whose tokenizer has no chat template."""
    return ValueError(
        f"model {model!r} has no chat template (no chat_template.jinja, no 'chat_template' in "
        f"tokenizer_config.json); pass chat_template=... to LLM.chat, for instance "
        f"jaxserve.engine.chat.CHATML_CHAT_TEMPLATE if the model was trained on ChatML"
    )
