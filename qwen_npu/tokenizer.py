"""Text <-> token ids with a checkpoint's own ``tokenizer.json`` (no transformers import)."""
from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Fast
        self.path = Path(path)
        self._tok = _Fast.from_file(str(self.path / "tokenizer.json"))
        cfg_file = self.path / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}

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
