"""Hugging Face repo ids resolved through the user's Hugging Face cache, with the network off.

The cache is laid out as ``huggingface_hub`` lays it out (``models--owner--name/`` with ``blobs/``
named by content hash, ``snapshots/<commit>/`` of links into them, ``refs/<branch>`` holding the
commit), and ``huggingface_hub.scan_cache_dir`` — its own reader — must accept it. Loading runs in
a child process so that ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE`` are read as a user's process reads
them, with a proxy that refuses every connection, so any network access would fail the test.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_npu import CheckpointError
from qwen_npu.model.hub import checkpoint_folder, looks_like_repo_id
from qwen_npu.testing import save_sharded

huggingface_hub = pytest.importorskip("huggingface_hub")

REPO = "tiny-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(cache: Path, folder: Path, repo_id: str = REPO, commit: str = COMMIT,
                  refs=("main",)) -> Path:
    """Put the files of ``folder`` into ``cache`` as huggingface_hub stores a downloaded snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def run_child(code: str, cache: Path, offline: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1" if offline else "0",
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    env.pop("HF_HOME", None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


GREEDY_TOKENS = """
import json
import qwen_npu
from qwen_npu import SamplingParams
for name, revision in {loads!r}:
    sess = qwen_npu.Session.from_pretrained(name, revision=revision, kernels="reference", chunk_size=8)
    out = sess.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=4, ignore_eos=True), progress=False)
    print(json.dumps({{"path": str(sess.path), "tokens": list(out[0].token_ids)}}))
"""


def greedy_tokens(folder) -> list[int]:
    import qwen_npu
    sess = qwen_npu.Session.from_pretrained(folder, kernels="reference", chunk_size=8)
    out = sess.generate([[1, 2, 3, 4, 5]], qwen_npu.SamplingParams(max_new_tokens=4, ignore_eos=True),
                        progress=False)
    return list(out[0].token_ids)


@pytest.fixture(scope="module")
def cached(tmp_path_factory, tiny_ckpt_small_vocab):
    """A sharded tiny checkpoint in a Hugging Face cache, under branch main and tag v1."""
    root = tmp_path_factory.mktemp("hf")
    sharded = save_sharded(tiny_ckpt_small_vocab, root / "sharded", max_shard_tensors=10)
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    cache = root / "hub"
    snapshot = lay_out_cache(cache, sharded, refs=("main", "v1"))
    return cache, snapshot, sharded


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(cached):
    cache, snapshot, sharded = cached
    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    (rev,) = repo.revisions
    assert rev.commit_hash == COMMIT and {"main", "v1"} <= set(rev.refs)
    assert {f.file_name for f in rev.files} == {p.name for p in sharded.iterdir()}


@pytest.mark.parametrize("offline", [True, False])
def test_a_repo_id_in_the_cache_loads_without_the_network(cached, tiny_ckpt_small_vocab, offline):
    """Offline or not, a cached model never reaches for the network (the proxy refuses all); by
    branch, tag and commit."""
    cache, snapshot, sharded = cached
    revisions = [None, "v1", COMMIT]
    done = run_child(GREEDY_TOKENS.format(loads=[(REPO, r) for r in revisions]), cache, offline)
    assert done.returncode == 0, done.stderr
    runs = [json.loads(line) for line in done.stdout.strip().splitlines()[-len(revisions):]]
    want = greedy_tokens(tiny_ckpt_small_vocab)
    for run in runs:
        assert Path(run["path"]) == snapshot and run["tokens"] == want


def test_a_missing_repo_id_says_where_it_looked_and_how_to_fetch_it(cached):
    cache, _, _ = cached
    code = ("import qwen_npu\n"
            "try:\n    qwen_npu.Session.from_pretrained('Qwen/Qwen3-0.6B', revision='main')\n"
            "except qwen_npu.CheckpointError as e:\n    print('ERROR', e)\n")
    done = run_child(code, cache, offline=True)
    assert done.returncode == 0, done.stderr
    msg = done.stdout
    assert msg.startswith("ERROR Qwen/Qwen3-0.6B at revision 'main'")
    assert str(cache) in msg and "HF_HUB_OFFLINE" in msg and "hf download Qwen/Qwen3-0.6B --revision main" in msg


def test_the_demo_and_the_bench_take_repo_ids(cached):
    """Both commands resolve the id to the cached snapshot: the demo names the folder it loads (the
    load itself is stubbed: the tour is tested elsewhere), the bench refuses this small-vocabulary
    model for the Qwen3-vocabulary workload naming the same folder."""
    cache, snapshot, _ = cached
    code = ("import qwen_npu.tools.demo as demo\n"
            "def load(path, **kw):\n    print('LOADS', path)\n    raise SystemExit(0)\n"
            "demo.Session.from_pretrained = load\n"
            "from qwen_npu.tools.cli import main\n"
            f"main(['demo', '--model', {REPO!r}])\n")
    done = run_child(code, cache, offline=True)
    assert done.returncode == 0, done.stderr
    assert f"LOADS {snapshot}" in done.stdout and f"the checkpoint at {snapshot}" in done.stdout
    code = f"from qwen_npu.tools.cli import main\nraise SystemExit(main(['bench', '--model', {REPO!r}, '--workload', 'seed']))"
    done = run_child(code, cache, offline=True)
    assert f"{snapshot}: the workload uses token ids up to" in done.stdout + done.stderr, done.stderr


def test_folders_and_names_that_are_neither(tmp_path, tiny_ckpt_small_vocab):
    assert checkpoint_folder(tiny_ckpt_small_vocab) == tiny_ckpt_small_vocab
    with pytest.raises(CheckpointError, match="revision='main' applies to a Hugging Face repo id"):
        checkpoint_folder(tiny_ckpt_small_vocab, revision="main")
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        checkpoint_folder(tmp_path / "missing" / "folder")
    assert looks_like_repo_id("Qwen/Qwen3-0.6B") and looks_like_repo_id("gpt2")
    for name in ("./x", "/abs/dir", "a/b/c", "a--b/c", "a/..", "", "a/b."):
        assert not looks_like_repo_id(name), name
