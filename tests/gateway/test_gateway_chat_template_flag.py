"""A model that ships no chat template (stories260K) served for chat through the gateway with
the official ``openai`` client, its template given to the tokenizer as a user types it:
``--chat-template chat.jinja``, a path relative to the working directory."""

from __future__ import annotations

import openai
import pytest

from services.tokenizer.text_tokenizer import TextTokenizer
from tests.helpers.gateway_stack import CHAT_TEMPLATE, serve_engine, serve_gateway_for, stop_all, wait_healthy, \
    write_routes
from tests.helpers.service_harness import STORIES_DIR

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


async def test_chat_with_a_template_given_as_a_relative_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    engine = await serve_engine(model=STORIES_DIR, tokenizer_flags=["--chat-template", "chat.jinja"])
    routes = write_routes(tmp_path / "routes.json", {"targets": [{"name": "e1", "address": engine[-1].address}],
                                                     "models": {"stories": "e1"}})
    gateway = await serve_gateway_for(routes)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="none", max_retries=0,
                                timeout=60)
    try:
        await wait_healthy(gateway, ["e1"])
        chat = await client.chat.completions.create(
            model="stories", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=12, temperature=0)
        # The same conversation rendered by hand and sent as token ids: the same prompt, the same reply.
        ids = TextTokenizer.from_dir(STORIES_DIR).encode("<|user|>Once upon a time\n<|assistant|>",
                                                         add_special_tokens=False)
        plain = await client.completions.create(model="stories", prompt=ids, max_tokens=12, temperature=0)
        assert chat.usage.prompt_tokens == len(ids) == plain.usage.prompt_tokens
        assert chat.choices[0].message.content == plain.choices[0].text and plain.choices[0].text
    finally:
        await client.close()
        await stop_all([gateway, *reversed(engine)])
