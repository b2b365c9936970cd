#!/usr/bin/env bash
# Installs what serving needs (scripts/setup.sh --serve: no test extra) and starts the
# OpenAI-compatible server on the bundled default model (SmolLM2-135M-Instruct), listening on
# 127.0.0.1:8000. Extra arguments go to `pagedkv serve` (e.g. --port 9000, --api-key KEY).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" --serve
exec "$root/.venv/bin/pagedkv" serve "$@"
