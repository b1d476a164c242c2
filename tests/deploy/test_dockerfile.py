"""The Dockerfile, checked without a container daemon (none runs here, nor in CI): everything it
copies exists and is in the build context .dockerignore leaves, its install steps are the
Makefile's own targets (with the runtime requirements alone), and the image it describes is the
one the manifests run (the checkout at /opt/tokenmill, its venv's python, a non-root user).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess

import pytest

from tests.deploy.manifests import IMAGE_ROOT, REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, rest))
    return found


def ignore_patterns() -> list[str]:
    return [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _matches(pattern: str, path: str) -> bool:
    pattern = pattern.strip("/")
    if pattern.startswith("**/"):
        tail = pattern[3:]
        parts = path.split("/")
        return any(_matches(tail, "/".join(parts[i:])) for i in range(len(parts)))
    parts = path.split("/")
    # A pattern matching a folder excludes (or lets in) everything under it.
    return any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def in_context(path: str) -> bool:
    """Whether .dockerignore leaves ``path`` (relative to the repository) in the build context:
    the last pattern that matches decides, ``!`` letting back in."""
    included = True
    for pattern in ignore_patterns():
        negate = pattern.startswith("!")
        if _matches(pattern.lstrip("!"), path):
            included = negate
    return included


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context (not from another stage)."""
    out = []
    for keyword, rest in instructions():
        if keyword != "COPY":
            continue
        words = shlex.split(rest)
        if any(w.startswith("--from=") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        out.append((words[:-1], words[-1]))
    return out


def test_dockerignore_semantics():
    """The matcher below follows Docker's rules on this file's own patterns."""
    assert not in_context(".venv/bin/python") and not in_context(".git/HEAD")
    assert in_context("services/scheduler/main.py") and in_context("models/stories260K/config.json")
    assert not in_context("services/common/pb/tokenmill/v1/common_pb2.py")
    assert not in_context("services/scheduler/__pycache__/main.cpython-311.pyc")
    assert not in_context("models/smollm2-135m-instruct/config.json")
    assert not in_context("tests/deploy/test_dockerfile.py")


def test_every_copy_source_exists_in_the_build_context():
    found = copies()
    assert found, "the Dockerfile copies nothing"
    for sources, _ in found:
        for source in sources:
            path = REPO_ROOT / source
            assert path.exists(), f"COPY {source}: no such file in the repository"
            files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
            kept = [p for p in files if in_context(str(p.relative_to(REPO_ROOT)))]
            assert kept, f"COPY {source}: .dockerignore leaves nothing of it in the build context"
            if path.is_file():
                assert in_context(source), f"COPY {source}: .dockerignore leaves it out"


def test_the_build_copies_what_make_runtime_reads():
    """Every file the Makefile's runtime recipe and pyproject need is copied (or the build fails)."""
    copied = {s.rstrip("/") for sources, _ in copies() for s in sources}
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    needed = {"Makefile", "pyproject.toml", "requirements.txt", "requirements-test.txt", "README.md", "scripts",
              "protos", "services", "models/stories260K"}
    assert needed <= copied, needed - copied
    for name in needed:
        assert any(line == name or line.startswith(name + "/") for line in tracked.splitlines()), name


def _make_runs() -> list[list[str]]:
    """The make command lines the Dockerfile's RUN steps execute (with ``$model`` as a MODELS entry)."""
    runs = []
    for keyword, rest in instructions():
        if keyword != "RUN":
            continue
        # make as a command (after &&, ;, do or an environment assignment), not a package name
        for match in re.finditer(r"(?:^|&&|;|\bdo|\bthen|\belse)\s*(?:[A-Z_]+=\S+\s+)*make\s+([^;&|]+)", rest):
            words = shlex.split(match.group(1).replace('"$model/config.json"', "models/smollm2-135m-instruct-q4_1/config.json"))
            runs.append(words)
    return runs


def test_install_steps_are_the_makefile_targets():
    runs = _make_runs()
    assert ["runtime", "REQUIREMENTS=requirements.txt"] in runs, runs
    for words in runs:
        done = subprocess.run(["make", "-n", "-B", "-C", str(REPO_ROOT), *words], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, f"make {' '.join(words)}: {done.stderr}"
    plan = subprocess.run(["make", "-n", "-B", "-C", str(REPO_ROOT), "runtime", "REQUIREMENTS=requirements.txt"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert "install -q -r requirements.txt\n" in plan, plan  # the runtime alone, no test tools
    # The CPU image: the hashed lock, every file checked.
    assert ["runtime", "REQUIREMENTS=requirements.txt", "LOCK=requirements-image.lock"] in runs, runs
    locked = subprocess.run(["make", "-n", "-B", "-C", str(REPO_ROOT), "runtime", "REQUIREMENTS=requirements.txt",
                             "LOCK=requirements-image.lock"], capture_output=True, text=True, timeout=60,
                            check=True).stdout
    assert "install -q --require-hashes --no-deps -r requirements-image.lock\n" in locked, locked
    assert "-r requirements.txt" not in locked and "--upgrade" not in locked, locked
    assert "scripts/gen_protos.py" in plan and "services.runtime.kernels.cpu" in plan, plan
    for keyword, rest in instructions():
        if keyword == "RUN":
            assert "pip install" not in rest, f"an install step outside the Makefile: {rest}"


def test_final_image_is_the_checkout_the_manifests_run():
    final = stages()[-1]
    workdirs = [rest for keyword, rest in final if keyword == "WORKDIR"]
    assert workdirs[-1] == IMAGE_ROOT
    assert any(keyword == "COPY" and "--from=build" in rest and rest.split()[-1] == IMAGE_ROOT
               for keyword, rest in final)
    env = " ".join(rest for keyword, rest in final if keyword == "ENV")
    assert f"PATH={IMAGE_ROOT}/.venv/bin:" in env
    assert (REPO_ROOT / ".venv" / "bin" / "python").exists()  # what /opt/tokenmill/.venv/bin/python is here
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_the_runtime_user_cannot_write_the_code_or_the_prebuilt_kernels():
    build, final = stages()[0], stages()[-1]
    copied = [rest for keyword, rest in final if keyword == "COPY" and "--from=build" in rest]
    assert copied and not any("--chown" in rest for rest in copied)  # root-owned: read-only to USER
    assert not any(keyword == "RUN" and ("chown" in rest or "chmod" in rest) and IMAGE_ROOT in rest
                   for keyword, rest in final)

    def env_of(stage) -> dict[str, str]:
        pairs = shlex.split(" ".join(rest for keyword, rest in stage if keyword == "ENV"))
        return dict(pair.split("=", 1) for pair in pairs if "=" in pair)

    # The kernels are built in the build stage, for a named -march, into the directory the
    # runtime stage loads them from (their build name hashes the flags and the checkout path).
    built, run = env_of(build), env_of(final)
    assert built["TORCH_EXTENSIONS_DIR"] == run["TORCH_EXTENSIONS_DIR"]
    assert run["TORCH_EXTENSIONS_DIR"].startswith(IMAGE_ROOT + "/")
    assert built["TOKENMILL_CPU_KERNEL_MARCH"] == run["TOKENMILL_CPU_KERNEL_MARCH"] == "${CPU_MARCH}"
    assert any(keyword == "RUN" and "make runtime" in rest for keyword, rest in build)
    assert any(keyword == "WORKDIR" and rest == IMAGE_ROOT for keyword, rest in build)


def test_variants_and_build_arguments():
    text = DOCKERFILE.read_text()
    for arg in ("VARIANT=cpu", "CPU_MARCH=x86-64-v3", "MODELS=", "TORCH_INDEX_URL="):
        assert f"ARG {arg}" in text, arg
    assert "download.pytorch.org/whl/cpu" in text and "cu128" in text
    # The base image by a digest given at build time; none is written here (none can be resolved
    # without a registry, and a stale one would pin the wrong image).
    assert "ARG PYTHON_IMAGE_DIGEST=\n" in text
    froms = [rest for keyword, rest in instructions() if keyword == "FROM"]
    assert froms and all(rest.startswith("${PYTHON_IMAGE}${PYTHON_IMAGE_DIGEST} AS ") for rest in froms), froms
    assert not re.search(r"sha256:[0-9a-f]{64}", text)


def default_command() -> list[str]:
    """The image's CMD, in its exec (JSON) form."""
    return json.loads(next(rest for keyword, rest in reversed(instructions()) if keyword == "CMD"))


@pytest.mark.slow
def test_default_command_serves_as_shipped(tmp_path):
    """The image's CMD, run here as the image runs it (from the checkout's root, with the venv's bin
    first on PATH), binding every interface; only the documented port variables are moved, so it
    can run beside another stack. It once exited at start: the gateway refused 0.0.0.0 without mTLS."""
    import os

    from tests.helpers.typed_up import SERVING, moved_ports, start_up, user_env

    command = default_command()
    assert command[:4] == ["tokenmill", "up", "--host", "0.0.0.0"]
    ports = moved_ports()
    env = user_env(PATH=f"{REPO_ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", TOKENMILL_LOG_DIR=str(tmp_path),
                   **ports)
    up = start_up(command, env)
    try:
        up.wait_for(SERVING, 240)
        curl = next(c for c in up.printed_commands() if c.startswith("curl "))
        assert f":{ports['TOKENMILL_GATEWAY_HTTP_PORT']}/" in curl
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        reply = json.loads(done.stdout)
        assert reply["choices"][0]["text"], reply
    finally:
        assert up.stop() == 0, up.text
