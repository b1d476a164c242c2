"""LoRA adapters as a user serves them: ``tokenmill up`` typed with ``--executor-arg=--lora=NAME=PATH``
flags (relative paths), the gateway's API keys allowing each tenant some adapters, and the
official openai client choosing an adapter by ``model``: its completions equal transformers +
peft's with the adapter merged, ``/v1/models`` lists the adapters under their parent, another
tenant's adapter is a model that does not exist, and the admin endpoints load and unload while
serving."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import grpc
import httpx
import openai
import pytest

from services.gateway.http.tokens import TokenNamer
from services.stack.client import generate
from tests.helpers.lora_adapters import BLOCK_SIZE, NEW_TOKENS, tiny_served, write_adapter
from tests.helpers.service_harness import REPO_ROOT
from tests.helpers.stack_streams import greedy_request

pytestmark = pytest.mark.slow  # starts the five services as processes

API_LINE = re.compile(r"OpenAI-compatible API: (\S+)/v1 .*routed gRPC: (\S+)")
KEYS = [{"key": "sk-tenant-a-0123456789", "tenant": "a", "adapters": ["all", "mlp"]},
        {"key": "sk-tenant-b-0123456789", "tenant": "b", "adapters": ["qv"]},
        {"key": "sk-operator-0123456789", "tenant": "ops", "admin": True}]
TENANT_A, TENANT_B, OPS = (k["key"] for k in KEYS)


@pytest.mark.timeout(300)
def test_openai_model_names_an_adapter_of_a_stack_started_with_lora_flags(tmp_path) -> None:
    model, paths, prompts, expected = tiny_served(tmp_path)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    keys.chmod(0o600)
    command = [sys.executable, "-m", "services.cli.main", "up", "--model", "model", "--port", "0", "--http-port", "0",
               "--gateway-port", "0", "--no-demo", "--log-dir", "logs", "--gateway-arg=--api-keys-file=keys.json",
               "--executor-arg=--dtype=fp32", f"--executor-arg=--block-size={BLOCK_SIZE}",
               "--executor-arg=--max-loras=2", "--executor-arg=--lora=all=all", "--executor-arg=--lora=qv=qv"]
    # Adapters load while serving from the working directory only (the scheduler's and the executor's --lora-dir).
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TOKENMILL_LORA_DIR": "."}
    (tmp_path / "escape").symlink_to(tmp_path.parent, target_is_directory=True)
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    try:
        base = routed = None
        for line in proc.stderr:
            stderr.append(line)
            if match := API_LINE.search(line):
                base, routed = match.groups()
                break
        assert base, "".join(stderr)
        namer = TokenNamer(str(model))
        a, b = (openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) for key in (TENANT_A, TENANT_B))

        def completion(client: openai.OpenAI, name: str, p: int) -> list[str]:
            """The greedy tokens, as the logprobs name them (random prompt ids make text that
            does not split cleanly where the prompt ends)."""
            choice = client.completions.create(model=name, prompt=prompts[p], max_tokens=NEW_TOKENS, temperature=0,
                                               logprobs=0, extra_body={"ignore_eos": True}).choices[0]
            return choice.logprobs.tokens

        def expect(name: str, p: int) -> list[str]:
            return [namer.name(token_id)[0] for token_id in expected[name][p]]

        listed = {m.id: m for m in a.models.list().data}
        assert sorted(listed) == ["all", "model"]  # qv is b's: not shown to a
        assert (listed["all"].parent, listed["all"].root, listed["model"].parent) == ("model", "all", None)
        for p in range(len(prompts)):
            assert completion(a, "all", p) == expect("all", p)
            assert completion(b, "qv", p) == expect("qv", p)
            assert completion(a, "model", p) == expect("", p)
        with pytest.raises(openai.NotFoundError) as hidden:
            completion(a, "qv", 0)
        assert "the model 'qv' does not exist" in str(hidden.value)
        assert hidden.value.body["code"] == "model_not_found"

        # The routed gRPC API holds a request's own adapter field to the key's list too.
        request = greedy_request(prompts[0], 2)
        request.adapter = "qv"
        with pytest.raises(grpc.RpcError) as bypass:
            list(generate(routed, request, timeout=60, token=TENANT_A))
        assert bypass.value.code() == grpc.StatusCode.NOT_FOUND and "the model 'qv' does not exist" in bypass.value.details()
        request.adapter = "all"
        assert len([m for m in generate(routed, request, timeout=60, token=TENANT_A) if m.HasField("delta")]) >= 1

        # The admin endpoint, with a key that may and one that may not.
        admin = httpx.Client(base_url=base, timeout=120)
        denied = admin.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": "mlp"},
                            headers={"Authorization": f"Bearer {TENANT_A}"})
        assert denied.status_code == 403 and '"admin": true' in denied.json()["error"]["message"]
        ops = {"Authorization": f"Bearer {OPS}"}
        loaded = admin.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": "mlp"}, headers=ops)
        assert loaded.status_code == 200, loaded.text
        assert (loaded.json()["id"], loaded.json()["parent"], loaded.json()["rank"]) == ("mlp", "model", 16)
        clash = admin.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": "all"}, headers=ops)
        assert clash.status_code == 409 and "replace=true" in clash.json()["error"]["message"]
        write_adapter(tmp_path / "r32", rank=32)
        too_big = admin.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": "r32"}, headers=ops)
        assert too_big.status_code == 400, too_big.text
        assert "field r: rank 32 exceeds max_lora_rank=16" in too_big.json()["error"]["message"]
        assert completion(a, "mlp", 1) == expect("mlp", 1)
        for path in ("../outside", "/etc", "escape"):
            escaped = admin.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, headers=ops)
            assert escaped.status_code == 400, escaped.text
            assert "outside the adapter directory --lora-dir=" in escaped.json()["error"]["message"], escaped.text
        gone = admin.post("/v1/unload_lora_adapter", json={"lora_name": "all"}, headers=ops)
        assert gone.status_code == 200, gone.text
        with pytest.raises(openai.NotFoundError):
            completion(a, "all", 0)
        unknown = admin.post("/v1/unload_lora_adapter", json={"lora_name": "all"}, headers=ops)
        assert unknown.status_code == 404 and "adapter 'all' is not loaded" in unknown.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
