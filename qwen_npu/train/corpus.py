"""The training text: English definitions and example sentences from WordNet 3.0.

WordNet comes as the Debian package ``wordnet-base`` (licence: the WordNet 3.0 licence, a
permissive BSD-style licence; Princeton University). Fetch and unpack it with

    apt-get download wordnet-base && dpkg -x wordnet-base_*.deb wordnet

which leaves the four ``data.{noun,verb,adj,adv}`` files under
``wordnet/usr/share/wordnet/`` (about 22 MB with their index fields; ``fetch_wordnet`` runs the
same two commands). Each synset line ends in ``| gloss; "example"; "example"``. One synset
becomes one paragraph of plain modern English::

    breathe means draw air into, and expel out of, the lungs. I can breathe better when the air is
    clean. The patient is respiring.

117,659 paragraphs, 10.9 MB of text (about 3.6M tokens of the 4096-token vocabulary). A synset
goes to the held-out split when a hash of its offset and part of speech says so, so the split
never depends on file order or on the seed.
"""
from __future__ import annotations

import hashlib
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "wordnet-base"
DATA_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
DATA_SUBDIR = Path("usr/share/wordnet")


@dataclass(frozen=True)
class Corpus:
    """Training and held-out paragraphs (one synset each), in a seeded order."""
    train: list[str]
    val: list[str]
    source: Path

    @property
    def num_bytes(self) -> int:
        return sum(len(p.encode()) + 1 for p in self.train + self.val)


def fetch_wordnet(dest: str | Path, timeout_s: float = 300.0) -> Path:
    """Download ``wordnet-base`` with apt and unpack it under ``dest``; return the data folder.

    Needs ``apt-get`` and ``dpkg`` (Debian or Ubuntu) and a reachable package mirror; when the
    data files are already there nothing is run.
    """
    dest = Path(dest)
    data = dest / DATA_SUBDIR
    if all((data / f).is_file() for f in DATA_FILES):
        return data
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"fetch_wordnet: '{tool}' is not on PATH; fetch the Debian package "
                                    f"'{PACKAGE}' by hand and pass its unpacked folder instead")
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", PACKAGE], cwd=dest, check=True, timeout=timeout_s)
    debs = sorted(dest.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise FileNotFoundError(f"fetch_wordnet: apt-get download left no {PACKAGE}_*.deb in {dest}")
    subprocess.run(["dpkg", "-x", str(debs[-1]), str(dest)], check=True, timeout=timeout_s)
    return data


def find_data_dir(root: str | Path) -> Path:
    """The folder holding ``data.noun`` etc.: ``root`` itself or ``root/usr/share/wordnet``."""
    root = Path(root)
    for cand in (root, root / DATA_SUBDIR):
        if all((cand / f).is_file() for f in DATA_FILES):
            return cand
    raise FileNotFoundError(f"{root}: no WordNet data files ({', '.join(DATA_FILES)}) here or under "
                            f"{DATA_SUBDIR}; fetch them with `apt-get download {PACKAGE} && "
                            f"dpkg -x {PACKAGE}_*.deb {root}`")


def paragraph(line: str) -> tuple[str, str] | None:
    """``(key, text)`` for one line of a WordNet data file, None for header or gloss-less lines."""
    if line.startswith(" ") or "|" not in line:
        return None
    fields, gloss = line.split("|", 1)
    parts = fields.split()
    offset, pos = parts[0], parts[2]
    lemma = parts[4].split("(")[0].replace("_", " ")
    definitions, examples = [], []
    for piece in gloss.strip().split(";"):
        piece = piece.strip()
        if not piece:
            continue
        if piece.startswith('"'):
            examples.append(_sentence(piece.strip('"').strip()))
        else:
            definitions.append(piece)
    if not definitions and not examples:
        return None
    text = f"{lemma} means {'; '.join(definitions)}." if definitions else ""
    text = " ".join([text, *filter(None, examples)]).strip()
    return f"{pos}{offset}", text


def _sentence(s: str) -> str:
    if not s:
        return ""
    s = s[0].upper() + s[1:]
    return s if s[-1] in ".!?" else s + "."


def is_held_out(key: str, val_percent: int) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < val_percent


def load_corpus(root: str | Path, *, seed: int = 0, val_percent: int = 2) -> Corpus:
    """Read the WordNet data files under ``root`` into shuffled train / held-out paragraphs."""
    if not 0 < val_percent < 50:
        raise ValueError(f"val_percent={val_percent}: choose 1..49")
    data = find_data_dir(root)
    train, val = [], []
    for name in DATA_FILES:
        with open(data / name, encoding="latin-1") as fh:
            for line in fh:
                item = paragraph(line)
                if item is None:
                    continue
                key, text = item
                (val if is_held_out(key, val_percent) else train).append(text)
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(val)
    return Corpus(train=train, val=val, source=data)
