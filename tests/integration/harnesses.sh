#!/usr/bin/env bash
# Prepare the real-client suite: install the agent harnesses it drives, Codex CLI and Claude Code,
# from npm into a cache folder (reused between runs). On success prints `CODEX=...` / `CLAUDE=...`
# lines (the two executables) on stdout and exits 0. When they cannot be had (no npm, the registry
# unreachable, a binary that does not run here) it prints one line
# `real-client suite: cannot prepare: <reason>` on stderr and exits 3.
#
# Environment:
#   GYMPROXY_NPM_DIR  where the harnesses are installed (default ~/.cache/gymproxy/npm)
set -uo pipefail

CODEX_VERSION=0.169.0
CLAUDE_VERSION=2.1.332
DIR=${GYMPROXY_NPM_DIR:-$HOME/.cache/gymproxy/npm}
STAMP="$DIR/.gymproxy-ready"
WANT="codex=$CODEX_VERSION claude-code=$CLAUDE_VERSION"
CODEX="$DIR/node_modules/.bin/codex"
CLAUDE="$DIR/node_modules/.bin/claude"

cannot() { echo "real-client suite: cannot prepare: $*" >&2; exit 3; }

# Both print their version and exit; a harness that cannot run on this machine fails here.
runs() {
    local codex claude
    codex=$(timeout 60 "$1/node_modules/.bin/codex" --version 2>&1) || return 1
    claude=$(timeout 60 "$1/node_modules/.bin/claude" --version 2>&1) || return 1
    [ "$codex" = "codex-cli $CODEX_VERSION" ] && [ "$claude" = "$CLAUDE_VERSION (Claude Code)" ] || return 1
    echo "harnesses: $codex, $claude" >&2
}

if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && runs "$DIR"; then
    echo "harnesses: reusing $DIR ($WANT)" >&2
else
    command -v npm >/dev/null || cannot "npm is not on PATH"
    # Install beside the cache and move it in place once it works, so a failed or concurrent
    # install never leaves a half-made cache behind.
    tmp="$DIR.tmp.$$"
    trap 'rm -rf "$tmp"' EXIT
    rm -rf "$tmp" && mkdir -p "$tmp" || cannot "cannot create $tmp"
    t0=$SECONDS
    if ! timeout 900 npm install --prefix "$tmp" --no-audit --no-fund --no-update-notifier --loglevel=error \
        "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_VERSION" >"$tmp.log" 2>&1; then
        tail -n 15 "$tmp.log" >&2
        rm -f "$tmp.log"
        cannot "npm could not install @openai/codex@$CODEX_VERSION and @anthropic-ai/claude-code@$CLAUDE_VERSION (see above)"
    fi
    rm -f "$tmp.log"
    echo "harnesses: npm install took $((SECONDS - t0)) s" >&2
    # Claude Code's postinstall puts the native binary in place of bin/claude.exe; an npm that
    # skips install scripts leaves a stub that only prints instructions, so run it once by hand.
    if ! runs "$tmp"; then
        (cd "$tmp/node_modules/@anthropic-ai/claude-code" && node install.cjs) >&2 || true
    fi
    runs "$tmp" || cannot "the installed harnesses do not run here: $("$tmp/node_modules/.bin/codex" --version 2>&1 | tail -n 1); $("$tmp/node_modules/.bin/claude" --version 2>&1 | tail -n 1)"
    echo "$WANT" >"$tmp/.gymproxy-ready"
    rm -rf "$DIR" && mkdir -p "$(dirname "$DIR")" && mv "$tmp" "$DIR" || cannot "cannot move the install to $DIR"
fi
echo "CODEX=$CODEX"
echo "CLAUDE=$CLAUDE"
