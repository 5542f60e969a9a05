#!/usr/bin/env bash
# The shared workloads on a CUDA GPU, qwen-npu beside Hugging Face generate on the same GPU.
#   bash docs/bench/run_gpu.sh [OUT_DIR]      (from the repository root; writes mixed.json, seed.json)
# Works from a plain checkout: when qwen_npu is not installed, qwen_npu/kernels is linked to kernels/.
set -uo pipefail
out=${1:-${OUT:-.}}
mkdir -p "$out"
python -c "import qwen_npu.kernels" 2>/dev/null || ln -sfn ../kernels qwen_npu/kernels
python - <<'PY' | tee "$out/machine.json"
import json, torch, transformers
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))
PY
for w in seed mixed; do
  python -m qwen_npu.cli bench --workload "$w" --device cuda --compare hf --json > "$out/$w.json" 2> "$out/$w.log"
  echo "$w: exit $?"; tail -c 600 "$out/$w.json"; echo
done
