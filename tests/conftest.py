"""Shared fixtures. The session-scoped checkpoints are shared by every test: treat them as
read-only (copy a folder with ``shutil.copytree`` before changing anything in it)."""
import pytest
import torch

from qwen_npu.testing import make_tiny_qwen3

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Default tiny Qwen3 (2 layers, hidden 64) with the real vocabulary, tokenizer and chat template."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_ckpt"))


@pytest.fixture(scope="session")
def tiny_ckpt_small_vocab(tmp_path_factory):
    """Default tiny Qwen3 with a 512-token vocabulary, no tokenizer files, eos 511."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_ckpt_small_vocab"), vocab_size=512)
