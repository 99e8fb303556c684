"""render_chat renders Hugging Face chat templates exactly as transformers does."""

from __future__ import annotations

import jinja2
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxserve.engine.chat import (
    CHATML_CHAT_TEMPLATE,
    missing_chat_template_error,
    render_chat,
)

# Meta-Llama-3-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Qwen2-Instruct's template (whitespace control with "-", tools rendered with tojson).
QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# No "-" whitespace control: output depends on trim_blocks / lstrip_blocks. Also exercises
# namespace, {% break %} (loopcontrols), {% generation %}, raise_exception, tojson of non-ASCII
# and HTML characters, and eos_token.
STRICT_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% break %}
    {% endif %}
{% endfor %}
{% if ns.system %}
<<SYS>>{{ ns.system | tojson }}<</SYS>>
{% endif %}
{% for message in messages if message['role'] != 'system' %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
    [INST] {{ message['content'] }} [/INST]
    {% else %}
    {% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
ANSWER:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": 'Be brief <& "quoted"> 你好'},
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? 😀"},
    ],
]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize(
    "template",
    [LLAMA3_TEMPLATE, QWEN2_TEMPLATE, STRICT_TEMPLATE, CHATML_CHAT_TEMPLATE],
    ids=["llama3", "qwen2", "strict", "chatml"],
)
def test_matches_transformers(
    hf_tokenizer, template: str, conversation: int, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    expected = hf_tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    got = render_chat(
        messages,
        template,
        add_generation_prompt=add_generation_prompt,
        bos_token=BOS,
        eos_token=EOS,
    )
    assert got == expected


def test_tools_match_transformers(hf_tokenizer) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city <b>now</b>",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = CONVERSATIONS[0]
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=QWEN2_TEMPLATE, tools=tools, tokenize=False
    )
    got = render_chat(messages, QWEN2_TEMPLATE, add_generation_prompt=False, tools=tools)
    assert got == expected
    assert '"Weather in a city <b>now</b>"' in got  # tojson does not HTML-escape


def test_add_generation_prompt_appends_the_assistant_header() -> None:
    messages = CONVERSATIONS[0]
    with_prompt = render_chat(messages, CHATML_CHAT_TEMPLATE)
    without = render_chat(messages, CHATML_CHAT_TEMPLATE, add_generation_prompt=False)
    assert without == "<|im_start|>user\nHello!<|im_end|>\n"
    assert with_prompt == without + "<|im_start|>assistant\n"


def test_template_raise_exception_surfaces_as_template_error() -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        render_chat(bad, STRICT_TEMPLATE)


def test_sandbox_blocks_attribute_escapes() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat(CONVERSATIONS[0], "{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat(CONVERSATIONS[0], "{% set ns = namespace(_x=1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable: the caller's list is safe
        render_chat(CONVERSATIONS[0], "{{ messages.append(1) }}")


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ("hi", TypeError, "messages must be a list"),
        ([], ValueError, "at least one message"),
        (["hi"], TypeError, r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], ValueError, r"messages\[0\] has no 'role'"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant"}],
            ValueError,
            r"messages\[1\] has no 'content'",
        ),
        (
            [{"role": "user", "content": None}],
            TypeError,
            r"messages\[0\]\['content'\] must be a str",
        ),
        ([{"role": 3, "content": "x"}], TypeError, r"messages\[0\]\['role'\] must be a str"),
        ([{"role": "", "content": "x"}], ValueError, r"messages\[0\]\['role'\] must not be empty"),
    ],
)
def test_bad_messages_raise(messages: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        render_chat(messages, CHATML_CHAT_TEMPLATE)  # type: ignore[arg-type]


def test_bad_tools_raise() -> None:
    with pytest.raises(TypeError, match="tools must be a list of dicts"):
        render_chat(CONVERSATIONS[0], QWEN2_TEMPLATE, tools=["get_weather"])  # type: ignore[list-item]


def test_missing_chat_template_error_names_the_model_and_the_fix() -> None:
    error = missing_chat_template_error("tiny-random-llama")
    assert isinstance(error, ValueError)
    assert "tiny-random-llama" in str(error) and "chat_template=" in str(error)
