"""Run a workload through vLLM's CPU build with the slot guard on, optionally injecting one fault.

usage (with the python of the venv .ci/setup-vllm makes):
    python engine_run.py MODEL_DIR SCENARIO[,SCENARIO...] [--scale S] [--eager]
SCENARIO: mixed | seed (a shared workload, scaled by S, or by X with NAME@X) | a fault name (injected once into a small
run) | raise:FAULT (the guard switched to raise mode first; put it last). One engine serves them
all in turn; each prints a JSON line starting with "RESULT ": the guard's steps for it, its
reports, the injected fault (step, check, request ids), the generate() seconds and any error.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the fault can be
injected into the runner; QWEN_NPU_VLLM_GUARD chooses the mode (unset: guard off, for timing).
"""
import argparse
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from qwen_npu.tools.workloads import custom, mixed, seed_like

FAULTS = ("copy_row0", "off_by_one", "past_blocks", "padding_slot0", "shared_block")


def workload(name, scale):
    """`scale` < 1 shrinks the shared workloads for CI (fewer requests, shorter prompts/outputs)."""
    if name == "mixed":
        n, lo, hi = max(4, round(32 * scale)), max(16, round(64 * scale)), max(32, round(512 * scale))
        return mixed(n=n, prompt_len=(lo, hi), output_len=(max(4, round(32 * scale)), max(8, round(128 * scale))))
    if name == "seed":
        return seed_like(n=max(4, round(16 * scale)), prompt_len=max(32, round(512 * scale)),
                         output_len=max(8, round(64 * scale)))
    raise SystemExit(f"unknown workload {name!r}")


class Injector:
    """Corrupts one step's slot mapping (in place, as a runner bug would) just before the guard sees it."""

    def __init__(self, fault):
        self.fault, self.done, self.record = fault, False, None

    def apply(self, runner, guard):
        from vllm.forward_context import get_forward_context
        if self.done or (guard is not None and runner.__dict__.get("_qwen_npu_step") != "pending"):
            return                     # with the guard on: only real steps, just before its check
        batch, table = runner.input_batch, runner.input_batch.block_table[0]
        rows = batch.num_reqs
        ids = list(batch.req_ids[:rows])
        qsl = [int(x) for x in runner.query_start_loc.np[:rows + 1]]
        slots = next(iter(get_forward_context().slot_mapping.values()))
        pos, bs = runner.positions, table.block_size
        tables, nb = table.block_table.gpu, table.num_blocks_per_row
        decode = rows >= 2 and qsl[rows] == rows
        hit = None
        if self.fault == "copy_row0" and decode:
            slots[rows - 1] = slots[0]
            hit = ("duplicate", [ids[0], ids[rows - 1]])
        elif self.fault == "off_by_one" and decode:
            slots[1] += 1
            hit = ("wrong_slot", [ids[1]])
        elif self.fault == "past_blocks" and decode:
            p = int(nb[1]) * bs                       # the first position the row has no block for
            pos[1] = p
            slots[1] = int(tables[1, int(nb[1])]) * bs   # whatever the stale table entry says
            hit = ("outside_blocks", [ids[1]])
        elif self.fault == "padding_slot0" and slots.shape[0] > qsl[rows]:
            slots[qsl[rows]] = 0
            hit = ("padding_write", ["padding-tail"])
        elif self.fault == "shared_block":
            owner = {}
            for r in range(rows):
                for b in tables[r, :int(nb[r])].tolist():
                    if b in owner and owner[b] != r:
                        t = qsl[r]                    # the row's first token writes into the shared block
                        slots[t] = b * bs + int(pos[t]) % bs
                        hit = ("shared_block", [ids[r]])
                        break
                    owner.setdefault(b, r)
                if hit:
                    break
        if hit:
            self.done = True
            self.record = {"fault": self.fault, "step": guard.steps_checked if guard else None, "check": hit[0],
                           "request_ids": hit[1]}


def shares_blocks(runner):
    """1 when two rows of the step hold one block (a shared prefix), else 0."""
    table = runner.input_batch.block_table[0]
    rows = runner.input_batch.num_reqs
    held = [b for r in range(rows) for b in table.block_table.gpu[r, :int(table.num_blocks_per_row[r])].tolist()]
    return int(len(held) != len(set(held)))


def pad_once(cls, injector):
    """For padding_slot0: make one decode step run padded by two tokens, as a graph-captured batch is."""
    orig = cls._determine_batch_execution_and_padding

    def padded(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if injector.done or self.input_batch.num_reqs < 2:
            return out
        import dataclasses
        desc = out[1]
        return (out[0], dataclasses.replace(desc, num_tokens=desc.num_tokens + 2), *out[2:])

    cls._determine_batch_execution_and_padding = padded


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("scenarios", help="comma-separated: mixed, seed, FAULT, raise:FAULT (raise last)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--eager", action="store_true", help="skip torch.compile (faster start)")
    ap.add_argument("--dtype", default=os.environ.get("PEER_DTYPE", "float32"))
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import qwen_npu.integrations.vllm as plugin
    llm = LLM(model=a.model, dtype=a.dtype, max_num_seqs=16, max_model_len=2048, seed=0,
              enable_prefix_caching=True, enforce_eager=a.eager)
    guard = plugin.guard()
    inner = GPUModelRunner._model_forward                # the guard's wrapper: a fault goes in first
    armed = {"injector": None, "sharing": 0}

    def faulty(self, *args, **kwargs):
        if armed["injector"] is not None:
            armed["injector"].apply(self, guard)
        elif self.__dict__.get("_qwen_npu_step") == "pending":
            armed["sharing"] += shares_blocks(self)
        return inner(self, *args, **kwargs)

    GPUModelRunner._model_forward = faulty

    def run(work):
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
        params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in work]
        return llm.generate(prompts, params, use_tqdm=False)

    run([(workload("mixed", 0.1)[0][0][:32], 4)])         # warm-up
    for name in a.scenarios.split(","):
        name, _, scale = name.partition("@")
        scale = float(scale) if scale else a.scale
        mode, _, fault = name.rpartition(":")
        if guard is not None and mode:
            guard.mode = mode
        injector = armed["injector"] = Injector(fault) if fault in FAULTS else None
        if fault == "padding_slot0":
            pad_once(GPUModelRunner, injector)
        first = guard.steps_checked if guard else 0
        armed["sharing"] = 0
        spent = guard.seconds if guard else 0.0
        error, seconds = None, None
        try:
            if fault == "shared_block":   # a cached 2-block prefix, then live requests sharing it
                bs = llm.llm_engine.vllm_config.cache_config.block_size
                base = custom(3 * bs, 2, n=1)[0][0]
                run([(base, 2)])
                work = [(base[:2 * bs + 8] + [101 + i] * 20, 6) for i in range(3)]
            elif fault in FAULTS:
                work = workload("mixed", 0.1)
            else:
                work = workload(fault, scale)
            t = time.perf_counter()
            outs = run(work)
            seconds = time.perf_counter() - t
            assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outs, work))
        except Exception as exc:  # noqa: BLE001 - raise mode: the guard's error, as vLLM surfaces it
            error, cause = "", exc
            while cause is not None and len(error) < 20000:
                error += f"{type(cause).__name__}: {cause}\n"
                cause = cause.__cause__ or cause.__context__
        armed["injector"] = None
        result = {"scenario": name, "seconds": seconds, "error": error,
                  "injected": injector.record if injector else None,
                  "steps": [first, guard.steps_checked] if guard else None,
                  "guard_seconds": guard.seconds - spent if guard else None,
                  "steps_sharing_blocks": armed["sharing"],
                  "reports": [r.to_json() for r in guard.reports if r.step >= first] if guard else None}
        print("RESULT " + json.dumps(result), flush=True)
        if error:
            break
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
        os._exit(0)                    # skip vLLM's slow teardown; everything is printed
    llm.llm_engine.engine_core.shutdown()   # the engine core process exits (and logs) normally


if __name__ == "__main__":
    main()
