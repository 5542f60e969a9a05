"""Train the small Qwen3 shipped with the package (``qwen_npu.testing.tiny_trained_qwen3``).

    corpus.py     WordNet 3.0 (Debian ``wordnet-base``) -> English paragraphs, held-out split
    tokenizer.py  byte-level BPE with the Qwen3 chat tokens, saved in Hugging Face format
    data.py       paragraphs -> token stream -> seeded training windows and copy rows
    model.py      the model's shape, transformers' Qwen3ForCausalLM, the checkpoint writer
    evaluate.py   held-out loss of a model and of the unigram baseline; induction heads
    trainer.py    the seeded training loop (from scratch or from a checkpoint) and its report
    card.py       the checkpoint's README with the WordNet licence

Run it with ``python -m qwen_npu.train --wordnet DIR --out DIR`` (docs/tiny-model.md).
"""
