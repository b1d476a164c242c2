"""Chat templates that define a tool-call format, for tests: SmolLM2's ChatML turns with a
Hermes ``<tool_call>`` convention in the system turn when the request has tools, written here in
the shape Qwen2.5's template has (tools as JSON lines inside <tools></tools>, the call format
spelled out, tool results as <tool_response> user turns)."""

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
{%- if not (loop.first and message['role'] == 'system') %}
{%- if message['role'] == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def smollm2_with_hermes_template(root: Path, weights: bool = True) -> Path:
    """A copy of SmolLM2-135M-Instruct whose tokenizer_config.json carries HERMES_TEMPLATE
    (``weights``: link the model's weights too, for an engine; a tokenizer needs none)."""
    target = root / "smollm2-hermes"
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
    config["chat_template"] = HERMES_TEMPLATE
    config_path.write_text(json.dumps(config))
    return target
