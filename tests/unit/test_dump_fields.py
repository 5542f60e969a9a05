"""Every malformed field of a dump is refused by name: ``load_dump`` raises InvalidRequestError
and ``qwen-npu inspect`` exits 2 with the field in its message, instead of a traceback."""
import copy
import json

import pytest

from qwen_npu import InvalidRequestError, load_dump
from qwen_npu.tools.cli import main

GOOD = {"format": "qwen-npu-dump", "version": 1, "meta": {"block_size": 4, "num_blocks": 8},
        "steps": [{"kind": "prefill", "index": 0, "slot_mapping": [8, 9], "block_tables": [[2, -1]],
                   "query_lens": [2], "num_active": 1, "request_ids": [0], "positions": [0, 1],
                   "seq_lens": [2], "input_ids": [5, 6], "token_ids": None}]}


def step_with(field, value):
    doc = copy.deepcopy(GOOD)
    doc["steps"][0][field] = value
    return doc


def doc_with(path, value):
    doc = copy.deepcopy(GOOD)
    *outer, last = path
    target = doc
    for k in outer:
        target = target[k]
    target[last] = value
    return doc


BAD = [
    # (document, the field the message must name, what it says)
    (step_with("kind", 3), "'kind'", "must be a string"),
    (step_with("index", "0"), "'index'", "must be an int"),
    (step_with("num_active", True), "'num_active'", "must be an int"),
    (step_with("slot_mapping", "8,9"), "'slot_mapping'", "must be a list"),
    (step_with("slot_mapping", [8, 9.5]), "'slot_mapping'", "item 1 must be an int"),
    (step_with("block_tables", [2, 3]), "'block_tables'", "row 0 must be a list of ints"),
    (step_with("block_tables", [[2, "x"]]), "'block_tables'", "row 0 item 1 must be an int"),
    (step_with("query_lens", {"0": 2}), "'query_lens'", "must be a list"),
    (step_with("positions", [0, None]), "'positions'", "item 1 must be an int"),
    (step_with("seq_lens", 2), "'seq_lens'", "must be a list"),
    (step_with("request_ids", ["a"]), "'request_ids'", "item 0 must be an int"),
    (step_with("input_ids", [[5]]), "'input_ids'", "item 0 must be an int"),
    (step_with("token_ids", 7), "'token_ids'", "must be a list"),
    (doc_with(["steps", 0], [1, 2]), "step #0", "must be a JSON object"),
    (doc_with(["steps"], {"0": {}}), "'steps'", "must be a list"),
    (doc_with(["meta"], [4]), "'meta'", "must be a JSON object"),
    (doc_with(["meta", "block_size"], "4"), "'meta.block_size'", "must be an int >= 1"),
    (doc_with(["meta", "block_size"], 0), "'meta.block_size'", "must be an int >= 1"),
    (doc_with(["meta", "num_blocks"], 2.5), "'meta.num_blocks'", "must be an int >= 1"),
]


def test_the_good_dump_is_read(tmp_path):
    path = tmp_path / "good.json"
    path.write_text(json.dumps(GOOD))
    dump = load_dump(path)
    assert dump.steps[0].slot_mapping == [8, 9] and dump.check()[0][1].ok
    assert main(["inspect", str(path)]) == 0


@pytest.mark.parametrize("doc, field, says", BAD, ids=[f"{f}:{s}" for _, f, s in BAD])
def test_a_malformed_field_is_named_and_inspect_exits_2(tmp_path, capsys, doc, field, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidRequestError) as e:
        load_dump(path)
    assert field in str(e.value) and says in str(e.value)
    assert main(["inspect", str(path)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("qwen-npu inspect: ") and field in out
