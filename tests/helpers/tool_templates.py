"""Chat templates that define a tool-call format, for tests, written here in the shapes the
public ones have:

- HERMES_TEMPLATE: SmolLM2's ChatML turns with a Hermes ``<tool_call>`` convention in the system
  turn when the request has tools, as Qwen2.5's template does it (tools as JSON lines inside
  <tools></tools>, the call format spelled out, an assistant's ``tool_calls`` written back as
  ``<tool_call>`` blocks with ``tool_call.arguments | tojson``, consecutive tool results in one
  user turn of <tool_response> blocks);
- LLAMA31_TEMPLATE: Llama 3.1's JSON tool calling (the tools in the first user turn, one call per
  assistant turn written as ``{"name": ..., "parameters": <arguments | tojson>}``, results as
  ``ipython`` turns, ``'tool_calls' in message`` deciding the branch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.service_harness import REPO_ROOT

SMOLLM2_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"

HERMES_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- 'You can call functions. Their signatures are inside <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call one, reply with a JSON object holding the function name and its arguments inside \
<tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n\
</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if loop.first and message['role'] == 'system' %}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message['role'] == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] | trim %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + system_message + '<|eot_id|>' }}
{%- if tools is not none %}
{%- if messages | length == 0 %}{{- raise_exception('tools go in the first user message, and there is none') }}{%- endif %}
{%- set first_user_message = messages[0]['content'] | trim %}
{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that \
best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of argument name \
and its value}. Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- (t | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}
{{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim) + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if message.tool_calls | length != 1 %}{{- raise_exception('one tool call per assistant turn') }}{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + tool_call.name + '", "parameters": ' }}
{{- (tool_call.arguments | tojson) + '}<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}\
{%- else %}{{- message.content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""


def smollm2_with_hermes_template(root: Path, weights: bool = True) -> Path:
    """A copy of SmolLM2-135M-Instruct whose tokenizer_config.json carries HERMES_TEMPLATE
    (``weights``: link the model's weights too, for an engine; a tokenizer needs none)."""
    return smollm2_with_template(root, "hermes", HERMES_TEMPLATE, weights)


def smollm2_with_template(root: Path, name: str, template: str, weights: bool = True) -> Path:
    """A copy of SmolLM2-135M-Instruct under ``root/smollm2-<name>`` whose tokenizer_config.json
    carries ``template``."""
    target = root / f"smollm2-{name}"
    if target.exists():
        return target
    target.mkdir(parents=True)
    for path in SMOLLM2_DIR.iterdir():
        if path.name == "model.safetensors":
            if weights:
                (target / path.name).symlink_to(path.resolve())
        elif path.is_file():
            shutil.copy(path, target / path.name)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return target
