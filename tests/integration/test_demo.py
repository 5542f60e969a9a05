"""`qwen-npu demo` runs, tells a coherent story, and the shipped model writes English."""
import re

from qwen_npu.tools.cli import main
from qwen_npu.tools.demo import MAX_NEW, PROMPTS


def test_demo_tour_output_makes_sense(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    # every wait is announced, and the setup (a first kernel build included) is timed apart
    assert re.search(r"loading it .*\n  ready in [\d.]+ s \(not counted below\)", out)
    assert re.search(r"\n  kernels: (cpu|reference) \(", out)
    # every prompt became a request with its own output stream, ended by eos or by its length
    for i, n in enumerate(MAX_NEW):
        m = re.search(rf"request {i} \((stop|length), (\d+) tokens\): \[([\d, ]+)\]", out)
        assert m, f"no output stream for request {i}"
        k = int(m.group(2))
        assert len(m.group(3).split(",")) == k and (k == n if m.group(1) == "length" else 1 <= k <= n)
    assert len(PROMPTS) == len(MAX_NEW)
    # the prompt longer than chunk_size was prefilled over several steps
    prefill_steps = re.findall(r"step \d+: rows \[[\d, ]+\] compute \[([\d, ]+)\] tokens", out)
    assert len(prefill_steps) >= 2
    assert all(sum(map(int, s.split(","))) <= 16 for s in prefill_steps)
    # a partial decode batch is shown with exactly as many slots as active rows
    m = re.search(r"partial batch: (\d+) of 3 requests.*?\n.*?request_ids +\[([\d, ]+)\].*?slot_mapping \[([\d, ]+)\]",
                  out, re.DOTALL)
    assert m
    active = int(m.group(1))
    assert len(m.group(2).split(",")) == active == len(m.group(3).split(","))
    # the shipped trained model continues every prompt with English words
    texts = [m[1] for m in re.findall(r""" -> (['"])(.*)\1$""", out, re.MULTILINE)]
    assert len(texts) == len(PROMPTS)
    for text in texts:
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 3 and sum(map(len, words)) >= len(text) // 2, text
    assert "trained on WordNet" in out
    assert re.search(r"tokens generated in [\d.]+ s; decode: \d+ steps, [\d.]+ tokens/s", out)
