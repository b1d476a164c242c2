"""Chat templates: exact rendering, the limits, and the sandbox."""

from __future__ import annotations

import pytest

from services.tokenizer import chat_template as ct
from services.tokenizer.chat_template import ChatTemplate, ChatTemplateError, render_chat
from services.tokenizer.text_tokenizer import TextTokenizer
from tests.helpers.tiny_bpe import CHATML_TEMPLATE, LLAMA_CONFIG, llama_style, write_model_dir

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 中文"},
]


def test_chatml_template_renders_exactly():
    template = ChatTemplate(CHATML_TEMPLATE)
    assert template.render(MESSAGES, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 中文<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render(MESSAGES, add_generation_prompt=False).endswith("Hi 中文<|im_end|>\n")


def test_bos_eos_trim_blocks_and_tojson_follow_transformers():
    source = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "  {% if m.role == 'user' %}[U]{{ m.content | tojson }}{% else %}[A]{{ m.content }}{{ eos_token }}{% endif %}\n"
        "{% endfor %}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    rendered = template.render([{"role": "user", "content": "é<b>"}, {"role": "assistant", "content": "ok"}])
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it
    # (without them: '<s>\n\n  [U]...'); tojson keeps "é" and does not HTML-escape "<b>".
    assert rendered == '<s>\n[U]"é<b>"[A]ok</s>'


def test_raise_exception_from_the_template_is_a_chat_template_error():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="chat template raised: first must be user"):
        template.render([{"role": "system", "content": "x"}])


def test_model_without_template_gives_a_clear_error(tmp_path):
    tokenizer = TextTokenizer.from_dir(write_model_dir(tmp_path, llama_style(), LLAMA_CONFIG))
    with pytest.raises(ChatTemplateError, match="this model has no chat template"):
        render_chat(tokenizer, MESSAGES)


def test_template_from_the_model_directory(tmp_path):
    config = dict(LLAMA_CONFIG, chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    tokenizer = TextTokenizer.from_dir(write_model_dir(tmp_path, llama_style(), config))
    assert render_chat(tokenizer, MESSAGES) == "<s>Be brief.Hi 中文"


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages.append({'role': 'x'}) }}",  # the immutable sandbox refuses mutation
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_blocks_internals_and_mutation(source):
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_template_size_limit():
    ChatTemplate("x" * ct.MAX_TEMPLATE_CHARS)
    with pytest.raises(ChatTemplateError, match=f"the limit MAX_TEMPLATE_CHARS is {ct.MAX_TEMPLATE_CHARS}"):
        ChatTemplate("x" * (ct.MAX_TEMPLATE_CHARS + 1))


def test_syntax_error_is_reported_with_its_line():
    with pytest.raises(ChatTemplateError, match=r"does not compile: .*\(line 2\)"):
        ChatTemplate("ok\n{% for m in messages %}")


def test_message_count_limit():
    template = ChatTemplate(CHATML_TEMPLATE)
    template.render([{"role": "user", "content": "a"}] * ct.MAX_MESSAGES)
    with pytest.raises(ChatTemplateError, match=f"the limit MAX_MESSAGES is {ct.MAX_MESSAGES}"):
        template.render([{"role": "user", "content": "a"}] * (ct.MAX_MESSAGES + 1))


def test_total_size_limit_counts_roles_strings_and_text_parts(monkeypatch):
    monkeypatch.setattr(ct, "MAX_TOTAL_CONTENT_CHARS", 18)  # two roles "user" and two contents of 5
    template = ChatTemplate("{{ messages | length }}")
    assert template.render([{"role": "user", "content": "12345"}, {"role": "user", "content": [{"type": "text", "text": "12345"}]}]) == "2"
    with pytest.raises(ChatTemplateError, match="exceed 18 characters .*MAX_TOTAL_CONTENT_CHARS"):
        template.render([{"role": "user", "content": "123456"}, {"role": "user", "content": [{"type": "text", "text": "12345"}]}])


def test_rendered_size_limit_stops_a_runaway_template(monkeypatch):
    monkeypatch.setattr(ct, "MAX_RENDERED_CHARS", 1000)
    looping = ChatTemplate("{% for i in range(100000) %}{% for m in messages %}{{ m.content }}{% endfor %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="exceeds 1000 characters .*MAX_RENDERED_CHARS"):
        looping.render([{"role": "user", "content": "0123456789"}])


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"content": "x"}], r"messages\[0\].role must be a non-empty string"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
    ],
)
def test_malformed_messages(messages, error):
    with pytest.raises(ChatTemplateError, match=error):
        ChatTemplate(CHATML_TEMPLATE).render(messages)


def test_template_type_error_on_client_input_is_a_chat_template_error():
    # ChatML concatenates content with "+": a null content is the request's fault.
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate(CHATML_TEMPLATE).render([{"role": "assistant", "content": None}])
