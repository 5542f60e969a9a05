"""Text <-> token ids with a checkpoint's own ``tokenizer.json`` (no transformers import)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError


class Tokenizer:
    """A checkpoint's tokenizer. Loading raises CheckpointError naming the file (and the field)
    for a ``tokenizer.json`` the tokenizers library cannot read or a malformed
    ``tokenizer_config.json``."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Fast
        self.path = Path(path)
        tok_file = self.path / "tokenizer.json"
        try:
            self._tok = _Fast.from_file(str(tok_file))
        except Exception as e:           # the tokenizers library raises a bare Exception
            raise CheckpointError(f"{tok_file}: not a readable tokenizer file ({e})") from None
        self.config = _read_config(self.path / "tokenizer_config.json")

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer | None":
        """The checkpoint's tokenizer, or None when the folder has no ``tokenizer.json``."""
        path = Path(path)
        return cls(path) if (path / "tokenizer.json").is_file() else None

    @property
    def fast(self):
        """The ``tokenizers.Tokenizer`` itself (streaming detokenization steps with it)."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        return self.config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """One token as readable text (special tokens kept)."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)


def _read_config(file: Path) -> dict:
    """``tokenizer_config.json`` as a dict ({} when absent), its chat template checked."""
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: must hold a JSON object, not {type(config).__name__}")
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str) and not (
            isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str)
                                               for t in template)):
        raise CheckpointError(f"{file}: field 'chat_template' must be a string or a list of "
                              f"{{'name': ..., 'template': ...}} objects, not {template!r:.60}")
    return config
