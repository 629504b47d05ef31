"""Directories written whole or not at all, each with a manifest of its files' sha256 that every reader checks
first: what an export (`barter.serialization`) and a training run's checkpoints (`barter.training`) are kept in."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

FORMAT = "barter-export"  # the manifest's format, an export's too
MANIFEST = "manifest.json"
TOPOLOGY = "topology.json"  # the file that makes a directory an export, which replace_directory may replace
WEIGHTS = "model.safetensors"  # the weights of an export, as of a Hugging Face model folder


class ExportError(ValueError):
    """An export that cannot be written, read, or fitted to its model; the message names the file, key or shape."""


def replace_directory(path: Path, fill: Callable[[Path], None], *, keep: Path | None = None) -> None:
    """Fill a fresh directory beside `path`, record its files in its manifest, then swap it in: `path` never
    holds a half-written export, and a reader finds every file checked in the manifest.

    The replaced directory moves to `keep` when given (replacing what was there: the one before it stays until
    this one is complete), else it is removed. Only an earlier export (a directory with topology.json) or an
    empty directory is replaced.
    """
    for target in (path, keep):
        if target is not None and target.exists() and not (
                (target / TOPOLOGY).is_file() or (target.is_dir() and not any(target.iterdir()))):
            raise ExportError(f"{target} exists and is not a barter export; refusing to replace it")
    staging, retired = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    for leftover in (staging, retired):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        fill(staging)
        write_manifest(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if path.exists():
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
        os.replace(path, retired if keep is None else keep)
    os.replace(staging, path)
    shutil.rmtree(retired, ignore_errors=True)


def write_manifest(directory: Path) -> None:
    """`directory/manifest.json`: every other file in `directory` with its sha256, written last and atomically."""
    files = {f.name: file_sha256(f) for f in sorted(directory.iterdir()) if f.is_file() and f.name != MANIFEST}
    staging = directory / (MANIFEST + ".tmp")
    staging.write_text(json.dumps({"format": FORMAT, "files": files}, indent=2) + "\n")
    os.replace(staging, directory / MANIFEST)


def read_manifest(directory: Path) -> dict[str, str]:
    """{file name: sha256} of `directory`'s manifest; ExportError naming it when it is missing or damaged."""
    file = directory / MANIFEST
    if not file.is_file():
        raise ExportError(f"{file} is missing: the directory's files cannot be verified")
    try:
        manifest = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{file} is damaged (not valid JSON: {e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT:
        raise ExportError(f"{file} is damaged (not a barter manifest)")
    return files


def verify_files(directory: Path, names: list[str] | None = None) -> None:
    """Check the files `names` of `directory` (default: all its manifest records) against its manifest; raise
    ExportError naming the first that is missing, unrecorded or changed since it was written."""
    recorded = read_manifest(directory)
    for name in recorded if names is None else names:
        file = directory / name
        if name not in recorded:
            raise ExportError(f"{file} is not recorded in {directory / MANIFEST}")
        if not file.is_file():
            raise ExportError(f"{file} is missing")
        digest = file_sha256(file)
        if digest != recorded[name]:
            raise ExportError(f"{file}: checksum mismatch (sha256 {digest}, recorded {recorded[name]} in "
                              f"{MANIFEST}); the file is damaged or was changed after it was written")


def file_sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
