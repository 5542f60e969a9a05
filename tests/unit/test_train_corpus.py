"""The training data path: WordNet lines to paragraphs, the held-out split, chat samples, batches."""
import itertools

import pytest
import torch

from qwen_npu.train import corpus, data
from qwen_npu.train.trainer import TrainConfig, learning_rate

NOUN = ('02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 001 @ 02083346 n 0000 | a member of the '
        'genus Canis that has been domesticated by man; "the dog barked all night"  \n')
ADJ = ('00001740 00 a 01 able 0 005 = 05200169 n 0000 | (usually followed by `to\') having the necessary '
       'means or skill; "able to swim"; "she was able to program her computer"  \n')
VERB_NO_EXAMPLE = '00002325 29 v 01 respire 1 005 $ 00001740 v 0000 | undergo respiration  \n'
MARKED_ADJ = '01234567 00 s 01 galore(ip) 0 000 | in great numbers; "apples galore"  \n'
HEADER = '  1 This software and database is being provided to you, the LICENSEE, by  \n'


def test_paragraph_reads_definition_and_examples():
    key, text = corpus.paragraph(NOUN)
    assert key == "n02084071"
    assert text == ("dog means a member of the genus Canis that has been domesticated by man. "
                    "The dog barked all night.")
    _, text = corpus.paragraph(ADJ)
    assert text.endswith("Able to swim. She was able to program her computer.")
    assert corpus.paragraph(VERB_NO_EXAMPLE)[1] == "respire means undergo respiration."
    assert corpus.paragraph(MARKED_ADJ)[1] == "galore means in great numbers. Apples galore."
    assert corpus.paragraph(HEADER) is None


def write_wordnet(root, lines_per_file=40):
    data_dir = root / corpus.DATA_SUBDIR
    data_dir.mkdir(parents=True)
    for i, name in enumerate(corpus.DATA_FILES):
        body = [HEADER]
        for k in range(lines_per_file):
            body.append(f"{i * 1000 + k:08d} 03 n 01 word{i}_{k} 0 000 | a thing number {k} of kind {i}; "
                        f'"the word{i} {k} is here"  \n')
        (data_dir / name).write_text("".join(body))
    return root


def test_load_corpus_split_is_stable_and_disjoint(tmp_path):
    root = write_wordnet(tmp_path)
    a = corpus.load_corpus(root, seed=0, val_percent=20)
    b = corpus.load_corpus(root, seed=5, val_percent=20)
    assert len(a.train) + len(a.val) == 4 * 40
    assert a.val and a.train and not set(a.train) & set(a.val)
    assert sorted(a.val) == sorted(b.val)              # the split does not depend on the seed ...
    assert a.train != b.train                          # ... the order does
    assert corpus.load_corpus(root, seed=0, val_percent=20) == a
    assert corpus.find_data_dir(root / corpus.DATA_SUBDIR) == root / corpus.DATA_SUBDIR


def test_missing_wordnet_says_how_to_fetch_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get download wordnet-base"):
        corpus.load_corpus(tmp_path)
    with pytest.raises(ValueError, match="val_percent"):
        corpus.load_corpus(write_wordnet(tmp_path), val_percent=0)


def test_chat_samples_follow_the_qwen3_format():
    chat = data.as_chat("dog means a domestic animal.")
    assert chat == ("<|im_start|>user\nWhat does dog mean?<|im_end|>\n"
                    "<|im_start|>assistant\ndog means a domestic animal.<|im_end|>\n")
    assert data.as_chat("The dog barked.") is None
    paras = [f"w{i} means thing {i}." for i in range(200)]
    out = data.with_chats(paras, seed=3)
    assert [p for p in out if not p.startswith("<|im_start|>")] == paras
    assert 5 < len(out) - len(paras) < 40               # about a tenth
    assert data.with_chats(paras, seed=3) == out


def test_batches_are_seeded_shifted_windows():
    stream = torch.arange(1000)
    a = data.Batches(stream, batch_size=4, seq_len=16, seed=1)
    b = data.Batches(stream, batch_size=4, seq_len=16, seed=1)
    x, y = a.next()
    x2, y2 = b.next()
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y[:, -1], x[:, -1] + 1)
    with pytest.raises(ValueError, match="too short"):
        data.Batches(torch.arange(10), batch_size=1, seq_len=16, seed=0)
    w = data.eval_windows(stream, 16, 5)
    assert w.shape == (5, 17) and w[1, 0] == 16


def test_learning_rate_warms_up_then_decays():
    cfg = TrainConfig(steps=1000, warmup_steps=100, lr=1e-3, min_lr_ratio=0.1)
    lrs = [learning_rate(cfg, s) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-5)
    assert max(lrs) == pytest.approx(1e-3)
    assert all(a <= b for a, b in itertools.pairwise(lrs[:100]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[100:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-2)


def test_model_card_keeps_the_wordnet_licence(tmp_path):
    from qwen_npu.train.card import SHORT_NOTICE, wordnet_licence
    root = write_wordnet(tmp_path)
    assert wordnet_licence(root / corpus.DATA_SUBDIR) == SHORT_NOTICE
    copyright_file = root / "usr/share/doc/wordnet-base/copyright"
    copyright_file.parent.mkdir(parents=True)
    copyright_file.write_text("Format: x\n\nFiles: *\nCopyright: 2006 Princeton University\nLicense: WordNet3.0\n"
                              " Permission to use.\n .\n No warranty.\n\nFiles: debian/*\nLicense: GPL-2+\n")
    assert wordnet_licence(root / corpus.DATA_SUBDIR) == (
        "Copyright: 2006 Princeton University\nLicense: WordNet3.0\nPermission to use.\n\nNo warranty.")


def test_copy_rows_repeat_random_tokens_from_the_given_range():
    stream = torch.arange(5000)
    x, y = data.Batches(stream, batch_size=4, seq_len=16, seed=2, copy_rows=2, copy_ids=(9, 40),
                        copy_len=(3, 5)).next()
    for row, target in zip(x[:2], y[:2]):
        n = next(n for n in (3, 4, 5) if torch.equal(row[n:], row[:-n]))
        assert bool(((row >= 9) & (row < 40)).all())            # only the ordinary ids asked for
        # the first copy's targets are random: left out of the loss; the rest copy
        assert bool((target[:n - 1] == data.IGNORE).all()) and bool((target[n - 1:] >= 9).all())
        assert torch.equal(target[n - 1:-1], row[n:]) and target[-1] == row[-n]
    for row in x[2:]:
        assert torch.equal(row[1:] - row[:-1], torch.ones(15, dtype=row.dtype))   # plain windows
    assert torch.equal(y[2:, :-1], x[2:, 1:]) and not bool((y[2:] == data.IGNORE).any())
    again = data.Batches(stream, batch_size=4, seq_len=16, seed=2, copy_rows=2, copy_ids=(9, 40), copy_len=(3, 5))
    assert torch.equal(again.next()[0], x)
    with pytest.raises(ValueError, match="copy_rows"):
        data.Batches(stream, batch_size=2, seq_len=16, seed=0, copy_rows=3, copy_ids=(9, 40))
    with pytest.raises(ValueError, match="copy_ids"):
        data.Batches(stream, batch_size=2, seq_len=16, seed=0, copy_rows=1, copy_ids=(40, 9))
    with pytest.raises(ValueError, match="copy_len"):
        data.Batches(stream, batch_size=2, seq_len=16, seed=0, copy_rows=1, copy_ids=(9, 40), copy_len=(4, 17))
