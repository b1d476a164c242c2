"""The tokenizer's --chat-template: a file's path or inline text stands in for a model's missing
template (stories260K ships none) or replaces its own; a value that is neither, or a template
that does not compile, stops the service at startup naming the flag."""

from __future__ import annotations

import pytest

from services.common.settings import parse_config
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.text_service import TextService
from services.tokenizer.text_tokenizer import read_chat_template_option
from tests.helpers.gateway_stack import CHAT_TEMPLATE
from tests.helpers.service_harness import STORIES_DIR

MESSAGES = [{"role": "user", "content": "Once upon a time"}]


def test_a_relative_file_path_typed_as_a_flag_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    config = parse_config(TokenizerConfig, ["--model", str(STORIES_DIR), "--chat-template", "chat.jinja"], env={})
    config.validate()
    assert config.template_text() == CHAT_TEMPLATE


def test_the_environment_variable_takes_inline_text():
    config = parse_config(TokenizerConfig, [], env={"TOKENMILL_TOKENIZER_CHAT_TEMPLATE": CHAT_TEMPLATE})
    assert config.template_text() == CHAT_TEMPLATE


@pytest.mark.parametrize("value", ["no-such-template.jinja", "chatml"])
def test_a_value_that_is_neither_a_file_nor_a_template_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=f"chat_template: '{value}' is not a file"):
        read_chat_template_option(value)


def test_a_model_without_a_template_renders_chat_with_the_given_one():
    assert not TextService(STORIES_DIR).facts.has_chat_template
    service = TextService(STORIES_DIR, CHAT_TEMPLATE)
    assert service.facts.has_chat_template
    rendered = service.render_chat(MESSAGES)
    assert rendered.text == "<|user|>Once upon a time\n<|assistant|>"
    assert rendered.token_ids == service.tokenizer.encode(rendered.text, add_special_tokens=False)


def test_the_given_template_replaces_the_models_own(tmp_path):
    from tests.helpers.gateway_stack import stories_with_chat_template

    model = stories_with_chat_template(tmp_path)
    service = TextService(model, "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert service.render_chat(MESSAGES).text == "[Once upon a time]"


def test_a_template_that_does_not_compile_stops_startup():
    with pytest.raises(ValueError, match="chat_template: .*unusable"):
        TextService(STORIES_DIR, "{% for m in messages %}")
