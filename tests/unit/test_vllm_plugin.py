"""The vLLM plugin without vLLM: environment switch, version gate, and the vllm-ascend adapter
driven through a stub `NPUModelRunner` (its methods stubbed, its attributes named as in vllm-ascend's
`worker/model_runner_v1.py`), imported after the plugin is registered so the import hook patches it."""
import logging
import sys
import textwrap
import types

import pytest

import qwen_npu.integrations.vllm as plugin
import qwen_npu.integrations.vllm.notices as notices
from qwen_npu.errors import SlotCollisionError

BS = 4

RUNNER_SRC = textwrap.dedent('''
    """Stand-in for vllm_ascend.worker.model_runner_v1 (attribute names as in vllm-ascend)."""
    import numpy as np
    import torch
    from vllm import forward_context


    class Buffer:
        def __init__(self, t):
            self.gpu, self.cpu, self.np = t, t, t.numpy()


    class NPUModelRunner:
        def __init__(self, step):
            self.forwards = []
            self.load(step)

        def load(self, step):
            rows = len(step["req_ids"])
            table = type("BlockTable", (), {})()
            table.block_table = Buffer(torch.tensor(step["tables"], dtype=torch.int32))
            table.num_blocks_per_row = np.array(step["blocks"], dtype=np.int32)
            table.block_size = step["bs"]
            table.dcp_world_size = 1
            self.input_batch = type("InputBatch", (), {})()
            self.input_batch.num_reqs = rows
            self.input_batch.req_ids = list(step["req_ids"]) + [None] * 3
            self.input_batch.block_table = [table]
            self.query_start_loc = Buffer(torch.tensor(step["qsl"] + [0] * 3, dtype=torch.int32))
            self.positions = torch.tensor(step["positions"], dtype=torch.int64)
            spec = type("FullAttentionSpec", (), {"block_size": step["bs"]})()
            group = type("KVCacheGroupSpec", (), {"kv_cache_spec": spec, "layer_names": ["l0", "l1"]})()
            self.kv_cache_config = type("KVCacheConfig", (), {"num_blocks": step["num_blocks"],
                                                              "kv_cache_groups": [group]})()
            self.slots = torch.tensor(step["slots"], dtype=torch.int32)

        def execute_model(self, scheduler_output, intermediate_tensors=None):
            meta = type("AscendMetadata", (), {"slot_mapping": self.slots})()
            forward_context.current = type("ForwardContext", (), {"attn_metadata": {"l0": meta, "l1": meta}})()
            n = self.slots.shape[0]
            return self._model_forward(n, None, self.positions[:n], None, None)

        def _dummy_run(self, num_tokens):
            forward_context.current = type("ForwardContext", (), {"attn_metadata": None})()
            return self._model_forward(num_tokens, None, None, None, None)

        def _model_forward(self, num_tokens_padded, input_ids=None, positions=None,
                           intermediate_tensors=None, inputs_embeds=None, **model_kwargs):
            self.forwards.append(num_tokens_padded)
            return num_tokens_padded
''')


def step(bad=None):
    """Two decoding rows and one prefilling row; a padded tail of one token."""
    tables = [[3, 4, 0], [7, 0, 0], [9, 10, 0]]
    positions = [5, 2, 0, 1, 2, 3, 4, 0]
    qsl = [0, 1, 2, 7]
    rows = [0, 1, 2, 2, 2, 2, 2]
    slots = [tables[r][p // BS] * BS + p % BS for r, p in zip(rows, positions)] + [-1]
    if bad == "copy_row0":
        slots[1] = slots[0]
    return {"req_ids": ["chat-a", "chat-b", "chat-c"], "tables": tables, "blocks": [2, 1, 2],
            "bs": BS, "qsl": qsl, "positions": positions, "slots": slots, "num_blocks": 16}


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """A `vllm` with a forward context, and a `vllm_ascend` package on disk; plugin state reset."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.27.1"
    fc = types.ModuleType("vllm.forward_context")
    fc.current = None
    fc.get_forward_context = lambda: fc.current
    vllm.forward_context = fc
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.forward_context", fc)
    pkg = tmp_path / "vllm_ascend" / "worker"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm_ascend" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model_runner_v1.py").write_text(RUNNER_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("vllm_ascend", "vllm_ascend.worker", "vllm_ascend.worker.model_runner_v1"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(plugin, "_guard", None)
    monkeypatch.setattr(notices, "_said", set())
    monkeypatch.setattr("atexit.register", lambda f: None)
    yield vllm
    for name in ("vllm_ascend", "vllm_ascend.worker", "vllm_ascend.worker.model_runner_v1"):
        sys.modules.pop(name, None)


def test_the_mode_comes_from_the_environment_and_a_typo_is_a_clear_error():
    assert plugin.mode_from_env({}) is None
    assert plugin.mode_from_env({"QWEN_NPU_VLLM_GUARD": "off"}) is None
    assert plugin.mode_from_env({"QWEN_NPU_VLLM_GUARD": " Raise "}) == "raise"
    with pytest.raises(ValueError, match="QWEN_NPU_VLLM_GUARD='loud': expected one of warn, count, raise"):
        plugin.mode_from_env({"QWEN_NPU_VLLM_GUARD": "loud"})


def test_unset_registers_nothing(fake_engine, monkeypatch):
    monkeypatch.delenv("QWEN_NPU_VLLM_GUARD", raising=False)
    plugin.register()
    assert plugin.guard() is None
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
    runner = NPUModelRunner(step("copy_row0"))
    assert runner.execute_model(None) == 8                   # runs, unchecked


def test_an_unsupported_version_does_nothing_and_says_so_once(fake_engine, monkeypatch, caplog):
    fake_engine.__version__ = "0.26.0"
    monkeypatch.setenv("QWEN_NPU_VLLM_GUARD", "raise")
    with caplog.at_level(logging.WARNING, logger="qwen_npu.guard"):
        plugin.register()
        plugin.register()
    assert plugin.guard() is None
    assert caplog.text.count("vLLM 0.26.0 is not supported") == 1
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
    assert NPUModelRunner(step("copy_row0")).execute_model(None) == 8


def test_ascend_runner_steps_are_checked_before_the_forward(fake_engine, monkeypatch):
    monkeypatch.setenv("QWEN_NPU_VLLM_GUARD", "raise")
    plugin.register()
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner  # patched on import
    runner = NPUModelRunner(step())
    assert runner.execute_model(None) == 8
    assert plugin.guard().steps_checked == 1 and not plugin.guard().reports
    runner.load(step("copy_row0"))
    with pytest.raises(SlotCollisionError) as err:
        runner.execute_model(None)
    assert "rows 0, 1 (requests chat-a, chat-b) both write slot 17 (block 4, offset 1)" in str(err.value)
    assert runner.forwards == [8]                              # the bad forward never ran
    runner._dummy_run(5)                                       # dummy runs are not steps: unchecked
    assert plugin.guard().steps_checked == 2 and runner.forwards == [8, 5]
    runner.load(step())
    runner.execute_model(None)                                 # still serving after the error
    assert runner.forwards == [8, 5, 8]


def test_a_runner_the_guard_cannot_read_turns_it_off_for_that_runner_once(fake_engine, monkeypatch, caplog):
    monkeypatch.setenv("QWEN_NPU_VLLM_GUARD", "count")
    plugin.register()
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
    runner = NPUModelRunner(step())
    del runner.kv_cache_config
    with caplog.at_level(logging.WARNING, logger="qwen_npu.guard"):
        assert runner.execute_model(None) == 8
        assert runner.execute_model(None) == 8
    assert caplog.text.count("cannot read the step from NPUModelRunner") == 1
    assert plugin.guard().steps_checked == 0
