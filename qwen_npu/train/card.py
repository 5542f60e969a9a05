"""The checkpoint's ``README.md``: what the model is, how it was trained, its numbers, and the
WordNet licence notice its training text comes with."""
from __future__ import annotations

from pathlib import Path

COPYRIGHT_FILE = Path("usr/share/doc/wordnet-base/copyright")


SHORT_NOTICE = ("WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved.\n"
                "(The full licence text is in the wordnet-base package: " + str(COPYRIGHT_FILE) + ")")


def wordnet_licence(data_dir: str | Path) -> str:
    """The WordNet 3.0 licence text from the unpacked Debian package holding ``data_dir`` (its
    ``Files: *`` stanza), or the short copyright notice when the package's copyright file is absent."""
    data_dir = Path(data_dir).resolve()
    found = [c / COPYRIGHT_FILE for c in (data_dir, *data_dir.parents) if (c / COPYRIGHT_FILE).is_file()]
    if not found:
        return SHORT_NOTICE
    text = found[0].read_text()
    stanza = text.split("Files: *", 1)[1].split("\nFiles:", 1)[0]
    lines = [line.removeprefix(" ") for line in stanza.splitlines()]
    return "\n".join("" if line == "." else line for line in lines).strip()


def stage_lines(report: dict) -> str:
    """One line per training stage of ``report`` (earlier stages first)."""
    lines = []
    for i, st in enumerate([*report.get("stages", []), report], 1):
        c = st["config"]
        copy = f", {c['copy_rows']} of them copy rows" if c.get("copy_rows") else ""
        lines.append(f"{i}. seed {c['seed']}, {c['steps']} steps of {c['batch_size']} x {c['seq_len']} tokens{copy}, "
                     f"peak learning rate {c['lr']:g}: {st['train_seconds']:.0f} s")
    return "\n".join(lines)


def write_model_card(out: str | Path, report: dict, licence: str) -> Path:
    """Write ``out/README.md`` from a training report and the WordNet licence text."""
    loss, ppl = report["held_out_loss"], report["held_out_perplexity"]
    heads = report.get("heads")
    head_text = "" if heads is None else (
        f"Best induction head: layer {heads['induction']['layer']}, head {heads['induction']['head']} "
        f"(score {heads['induction']['score']:.2f}); best previous-token head: layer "
        f"{heads['previous_token']['layer']}, head {heads['previous_token']['head']} "
        f"(score {heads['previous_token']['score']:.2f}).\n")
    card = f"""# tiny-qwen3-wordnet

A {report['parameters'] / 1e6:.1f}M-parameter Qwen3 (`Qwen3ForCausalLM`) trained from scratch on the
definitions and example sentences of WordNet 3.0 by `python -m qwen_npu.train`, on a shared 2-core
CPU, in these stages:

{stage_lines(report)}

It writes short English phrases; it knows nothing reliable about the world.

Held-out loss (nats per token): trained {loss['trained']:.3f} (perplexity {ppl['trained']:.1f}),
unigram baseline {loss['unigram']:.3f} ({ppl['unigram']:.1f}), untrained {loss['untrained']:.3f}
({ppl['untrained']:.1f}). {head_text}Details: `training_report.json` and `docs/tiny-model.md` of qwen-npu.

## Training data licence

The training text is derived from WordNet 3.0 (Debian package `wordnet-base`), under this licence:

```
{licence}
```
"""
    path = Path(out) / "README.md"
    path.write_text(card)
    return path
