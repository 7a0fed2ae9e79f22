"""Where a model's files come from: the built-in demo, a local directory, or the Hugging Face hub."""

from __future__ import annotations

import json
import os
from pathlib import Path

from yutu.errors import StartupError

DEFAULT_MODEL_NAME = "yutu-demo-tiny"  # the built-in demo model's served name (kept torch-free here)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.md"]


def resolve_model(path_or_id: str | None) -> Path:
    """The local directory of the model to serve.

    None -> the built-in demo model (created on first use); an existing directory -> itself; a
    string shaped like a hub id ("org/name") -> its snapshot via huggingface_hub (the local hub cache
    first, then the network). Raises ValueError saying how to pass a local directory otherwise, or
    how to make one readable that this user cannot read.
    """
    if path_or_id is None:
        from yutu.engine.default_model import ensure_default_model  # imports torch: only when needed

        return ensure_default_model()
    path = Path(path_or_id).expanduser()
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(
                    f"{path} is a directory but holds no config.json: pass a Hugging Face model directory"
                )
            return path
        if path.exists():
            raise ValueError(f"{path} is a file: pass a Hugging Face model directory (with config.json)")
    except PermissionError as exc:
        raise ValueError(
            f"cannot read model directory {path} ({exc.strerror}: {exc.filename}) as uid {os.getuid()}:"
            f" make it readable, e.g. `chmod -R a+rX {path}`"
        ) from exc
    if _looks_like_path(path_or_id):
        raise ValueError(f"model directory {path} does not exist: pass an existing local directory")
    return _from_hub(path_or_id)


def model_to_serve(path_or_id: str | None) -> Path:
    """:func:`resolve_model` for a service's --model: one it cannot serve is a StartupError (one
    log line and exit 1, no traceback)."""
    try:
        return resolve_model(path_or_id)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc


def served_model_name(path_or_id: str | None, model_dir: Path) -> str:
    """The name clients use for a model when none is configured.

    The demo model is ``yutu-demo-tiny`` (its directory carries a version suffix), a hub id is
    itself, and a local checkpoint is its directory's name.
    """
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("yutu_demo"):
        return DEFAULT_MODEL_NAME
    if path_or_id is not None and not Path(path_or_id).expanduser().exists():
        return path_or_id
    return model_dir.name


def _looks_like_path(value: str) -> bool:
    """Hub ids are "name" or "org/name"; anything else is meant as a filesystem path."""
    return value.startswith((".", "/", "~")) or value.count("/") > 1 or "\\" in value or value.endswith("/")


def _from_hub(repo_id: str) -> Path:
    local_hint = f"download it elsewhere (e.g. `hf download {repo_id} --local-dir DIR`) and pass the local directory DIR"
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ValueError(
            f"{repo_id!r} is not a local directory and huggingface_hub is not installed: {local_hint}"
        ) from exc
    try:  # the hub cache first: works offline
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except Exception:  # noqa: BLE001 -- any failure here just means "not cached"
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # noqa: BLE001 -- network, auth, missing repo: all end the same way
        raise ValueError(
            f"could not fetch model {repo_id!r} from the Hugging Face hub ({exc}); {local_hint}"
        ) from exc
