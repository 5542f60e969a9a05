"""From what a user names — a checkpoint folder or a Hugging Face repo id — to a folder on disk.

    "/data/Qwen3-0.6B"       an existing folder: used as it is
    "Qwen/Qwen3-0.6B"        a repo id: its snapshot in the Hugging Face cache, as ``transformers``
                             finds it (``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` honoured)

A repo id is looked up in the cache first, without touching the network, so a model that is
already there loads offline and at once. Only when it is missing, and the hub is not offline, is it
downloaded (the files a Session reads: config, tokenizer, generation config, safetensors). A
missing model raises ``CheckpointError`` naming the cache folder it looked in and the command that
fetches it. ``huggingface_hub`` (a dependency of ``transformers``) is imported only for repo ids.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import CheckpointError

# What a Session reads from a checkpoint; nothing else is downloaded.
PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")
# owner/name or name, as the hub spells them: letters, digits, "-", "_", "."; no "--" or ".." in a name
REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def looks_like_repo_id(name: str) -> bool:
    return bool(REPO_ID.match(name)) and ".." not in name and "--" not in name and not name.endswith(".")


def checkpoint_folder(name_or_path, revision: str | None = None) -> Path:
    """The folder holding the checkpoint ``name_or_path`` names (see the module docstring).

    ``revision`` (a branch, tag or commit of a repo id) is refused for a folder, which has none."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if revision is not None:
            raise CheckpointError(f"{path}: revision={revision!r} applies to a Hugging Face repo id, "
                                  f"and this is a local folder")
        return path
    name = str(name_or_path)
    if not looks_like_repo_id(name):
        raise CheckpointError(f"{name}: no such checkpoint folder (and not a Hugging Face repo id)")
    return _from_hub(name, revision)


def _from_hub(repo_id: str, revision: str | None) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(f"{repo_id}: no such folder; to load it as a Hugging Face repo id, "
                              f"install huggingface_hub (pip install huggingface_hub)") from None
    where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, local_files_only=True,
                                                      allow_patterns=list(PATTERNS)))
    except LocalEntryNotFoundError:
        pass
    cache = constants.HF_HUB_CACHE
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    if constants.is_offline_mode():
        raise CheckpointError(f"{where}: not a folder, and not in the Hugging Face cache ({cache}); the hub "
                              f"is offline (HF_HUB_OFFLINE), so it was not downloaded. On a machine with "
                              f"network access run `{fetch}` (with the same HF_HOME / HF_HUB_CACHE), or "
                              f"pass the checkpoint's folder") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                      allow_patterns=list(PATTERNS)))
    except Exception as e:  # noqa: BLE001 - any failure of the download is reported the same way
        raise CheckpointError(f"{where}: not a folder, not in the Hugging Face cache ({cache}), and the "
                              f"download failed ({type(e).__name__}: {e}). Run `{fetch}` where the hub can be "
                              f"reached, or pass the checkpoint's folder") from None
