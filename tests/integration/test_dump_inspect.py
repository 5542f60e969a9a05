"""Step dumps: to_dict / dump / load_dump round trip, and `qwen-npu inspect` finding a collision."""
import json

import pytest

from qwen_npu import InvalidRequestError, SamplingParams, Session, load_dump
from qwen_npu.tools.cli import main


def open_session(path, **kw):
    args = dict(device="cpu", max_batch=4, block_size=4, num_blocks=64, max_model_len=64, chunk_size=8)
    return Session.from_pretrained(path, **{**args, **kw})


def run_two(sess):
    sess.add_request([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True))
    sess.add_request([6, 7, 8], SamplingParams(max_new_tokens=3, ignore_eos=True))
    while any(not r.is_done for r in sess.requests):
        sess.step()


def test_dump_round_trip(tiny_ckpt_small_vocab, tmp_path):
    sess = open_session(tiny_ckpt_small_vocab)
    run_two(sess)
    path = sess.dump(tmp_path / "run.json", logits_topk=3)
    doc = json.loads(path.read_text())          # plain JSON
    assert doc["format"] == "qwen-npu-dump" and doc["version"] == 1 and doc["meta"]["block_size"] == 4
    d = load_dump(path)
    assert len(d.steps) == len(sess.history)
    for got, step in zip(d.steps, sess.history):
        assert got.kind == step.kind and got.index == step.index
        assert got.slot_mapping == step.slot_mapping.tolist() and got.positions == step.positions.tolist()
        assert got.input_ids == step.input_ids.tolist() and got.query_lens == step.query_lens.tolist()
        assert got.seq_lens == step.seq_lens.tolist() and got.request_ids == step.request_ids
        assert got.token_ids == step.token_ids.tolist() and got.num_active == step.num_active
        assert got.block_tables == [[b for b in row if b >= 0] for row in step.block_tables.tolist()]
        stored = {k: v for k, v in got.raw.items() if k != "logits_topk"}
        assert stored == step.to_dict()
    # top-k logits are kept for the steps whose device logits were still live: the last of each kind
    last = sess.history[-1]
    topk = d.steps[-1].raw["logits_topk"]
    values, ids = last.logits.topk(3)
    assert topk["ids"] == ids.tolist() and topk["values"] == values.tolist()      # exact through JSON
    assert all(r.ok for _, r in d.check())


def test_dump_selected_steps_and_unknown_step(tiny_ckpt_small_vocab, tmp_path):
    sess = open_session(tiny_ckpt_small_vocab)
    run_two(sess)
    d = load_dump(sess.dump(tmp_path / "two.json", steps=[0, sess.history[-1]]))
    assert [s.index for s in d.steps] == [0, sess.history[-1].index]
    with pytest.raises(InvalidRequestError, match="not in sess.history"):
        sess.dump(tmp_path / "bad.json", steps=[999])


def test_inspect_reports_the_collision_of_a_replicate_padding_run(tiny_ckpt_small_vocab, tmp_path, capsys):
    sess = open_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="off")
    run_two(sess)
    path = sess.dump(tmp_path / "replicate.json")
    assert main(["inspect", str(path)]) == 1
    out = capsys.readouterr().out
    decode = [s for s in load_dump(path).steps if s.kind == "decode"][0]
    assert decode.batch_size == 4 and decode.num_active == 2
    slot = decode.slot_mapping[0]
    assert f"step {decode.index} (decode): 4 rows, 2 active" in out
    ids = decode.request_ids[:2]
    assert f"requests {ids} + 2 padding rows" in out            # padding rows are not requests
    assert f"write slot {slot}" in out and "padding" in out
    assert "PROBLEM" in out and "steps have slot problems" in out


def test_inspect_a_dump_written_by_another_runner(tmp_path, capsys):
    """The minimal fields of docs/dump-format.md: one decode step where rows 0 and 2 share a slot."""
    doc = {"format": "qwen-npu-dump", "version": 1, "meta": {"block_size": 16},
           "steps": [{"kind": "decode", "slot_mapping": [35, 80, 35], "block_tables": [[2], [5], [2]],
                      "seq_lens": [4, 1, 4]}]}
    path = tmp_path / "other.json"
    path.write_text(json.dumps(doc))
    assert main(["inspect", str(path), "-v"]) == 1
    out = capsys.readouterr().out
    assert "rows 0, 2 both write slot 35" in out and "slot_mapping [35, 80, 35]" in out
    assert "3 tokens, no request ids recorded" in out              # none invented for another runner
    doc["steps"][0]["slot_mapping"] = [35, 80, -1]
    path.write_text(json.dumps(doc))
    assert main(["inspect", str(path)]) == 0


HEAD = '"format": "qwen-npu-dump", "version": 1'


@pytest.mark.parametrize("content, why", [
    ("not json", "not a readable JSON dump"), ('{"format": "other"}', "not a qwen-npu-dump"),
    ("{" + HEAD + ', "meta": {}}', "block_size"),
    ("{" + HEAD + ', "meta": {"block_size": 4}, "steps": [{"kind": "decode"}]}', "lacks slot_mapping"),
])
def test_bad_dump_files_are_refused_clearly(tmp_path, capsys, content, why):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InvalidRequestError, match=why):
        load_dump(path)
    assert main(["inspect", str(path)]) == 2
    assert why in capsys.readouterr().out
