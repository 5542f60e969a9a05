"""Text in and out: the tokenizer wrapper and chat templates."""
