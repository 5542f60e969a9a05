"""qwen_npu's checks inside other serving engines.

- `step_guard`: `StepGuard` screens each step an engine is about to run with the slot checks.
- `vllm`: the vLLM plugin (entry point `vllm.general_plugins`, extra `vllm-guard`), off unless
  `QWEN_NPU_VLLM_GUARD=warn|count|raise` is set.
"""
