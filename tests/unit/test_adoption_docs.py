"""What the docs tell a newcomer and an adopter agrees with what the code does:

- the AI SDK chat POST's triggers: the ones ``parse_chat`` takes are the ones
  docs/PROTOCOL.md and docs/HTTP.md name, and the one it refuses is the 400 they say;
- the README's own-backend programs import only what ``make demo``'s venv holds (the
  package and the extras the Makefile's DEMO_EXTRAS names), and read their settings
  from the variables the demo's ``backend.env`` sets;
- the producer's stated Node versions (README, its README, package.json) are one;
- DEPLOY.md's compose command sets every variable docker-compose.yml requires;
- a command the docs give to run a test installs pytest first (``make demo``'s venv has
  none).
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

from devstack.demo.backend import backend_env
from tests.e2e.test_examples import example
from worker.fronts.aisdk.http import ChatError, parse_chat

ROOT = Path(__file__).resolve().parents[2]


def _read(path: str) -> str:
    return (ROOT / path).read_text()


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def _chat(trigger: str) -> None:
    user = {"role": "user", "parts": [{"type": "text", "text": "hi"}]}
    parse_chat(json.dumps({"id": "s1", "trigger": trigger, "messages": [user]}).encode(), 100)


@pytest.mark.parametrize("doc", ["docs/PROTOCOL.md", "docs/HTTP.md"])
def test_the_chat_triggers_the_docs_name_are_the_ones_taken(doc: str) -> None:
    _chat("submit-message")
    _chat("regenerate-message")  # taken: both docs say so
    text = " ".join(_read(doc).split())
    assert "`regenerate-message`" in text, f"{doc} does not say regenerate-message is taken"
    assert "other than `submit-message` is a 400" not in text
    with pytest.raises(ChatError) as refused:
        _chat("resume-stream")
    assert refused.value.status == 400


def _demo_extras() -> list[str]:
    m = re.search(r"^DEMO_EXTRAS\s*:=\s*(\S+)$", _read("Makefile"), re.M)
    assert m, "the Makefile has no DEMO_EXTRAS"
    return m.group(1).split(",")


def test_the_readme_backend_programs_import_what_make_demo_installs() -> None:
    project = tomllib.loads(_read("pyproject.toml"))["project"]
    installed = _requirement_names(project["dependencies"])
    for extra in _demo_extras():
        installed |= _requirement_names(project["optional-dependencies"][extra])
    tree = ast.parse(example("producer-py"))
    imported = {
        ((n.module or "") if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    own = {"relay", "worker", "tokenrelay"}
    missing = sorted(m for m in imported - own - set(sys.stdlib_module_names)
                     if m.replace("_", "-") not in installed)  # fmt: skip
    assert missing == [], f"README's Python producer imports what make demo lacks: {missing}"
    # no top-level await/async with: a script runs it with python
    assert not [n for n in tree.body if isinstance(n, ast.AsyncWith | ast.Await | ast.Expr)
                and isinstance(getattr(n, "value", None), ast.Await)]  # fmt: skip
    assert not any(isinstance(n, ast.AsyncWith) for n in tree.body)


@pytest.mark.parametrize("block", ["producer-py", "producer-ts"])
def test_the_backend_programs_read_what_the_demo_file_sets(block: str) -> None:
    code = example(block)
    demo = backend_env("redis://127.0.0.1:1", "s" * 43, "http://127.0.0.1:8080/", "k", "mock")
    read = set(re.findall(r"\b(TOKENRELAY_[A-Z_]+|OPENAI_MODEL)\b", code))
    assert read, code
    assert read <= set(demo), sorted(read - set(demo))
    assert "127.0.0.1:7000" not in code  # the demo's Redis port is its own per run


def test_the_stated_node_versions_agree() -> None:
    engines = json.loads(_read("clients/producer/package.json"))["engines"]["node"]
    assert engines == ">=20"
    readme = _read("README.md").split("## Stream from your own backend")[1]
    assert "Node 20 or later" in readme
    assert "Node 18" not in readme
    assert "Node >= 20" in _read("clients/producer/README.md")


def test_the_compose_command_sets_every_required_variable() -> None:
    required = set(re.findall(r"\$\{([A-Z_]+):\?", _read("docker-compose.yml")))
    assert required >= {"TOKENRELAY_SECRET", "RABBITMQ_PASSWORD"}
    deploy = _read("docs/DEPLOY.md")
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", deploy, re.S) if "compose up" in b]
    assert blocks, "DEPLOY.md gives no docker compose up command"
    missing = [v for v in sorted(required) if f"{v}=" not in blocks[0]]
    assert missing == [], f"DEPLOY.md's docker compose up sets no {missing}"


@pytest.mark.parametrize("doc", ["docs/DURABLE.md", "README.md", "docs/DEMO.md"])
def test_a_test_command_in_the_docs_installs_pytest_first(doc: str) -> None:
    blocks = re.findall(r"```(?:sh)?\n(.*?)```", _read(doc), re.S)
    for block in blocks:
        if ".venv/bin/python -m pytest" in block:
            before = block.split(".venv/bin/python -m pytest")[0]
            assert "pip install" in before, block
            assert "test" in before, block
