"""``python -m devstack llama``: where the engine is, or one line saying why not."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack.cli import main
from devstack.llama import build


def test_where_without_a_build_is_one_line_and_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENRELAY_LLAMA_CACHE", str(tmp_path))
    assert main(["llama", "where"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: ")
    assert "python -m devstack llama build" in err


def test_a_missing_toolchain_is_one_line_and_no_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENRELAY_LLAMA_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert build.missing_toolchain() == "llama-server cannot be built here: cmake is not installed"
    assert main(["llama", "build"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: llama-server cannot be built here: cmake is not installed"
    assert not (tmp_path / build.LLAMA_CPP_PYTHON / "work").exists()  # nothing fetched
