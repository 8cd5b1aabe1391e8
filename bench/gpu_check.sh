#!/usr/bin/env bash
# The one-command GPU check: the GPU test tier, then every GPU measurement, into OUT (see bench/gpu_check.py).
#   bash bench/gpu_check.sh OUT [--quick] [--dry-run]
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_check.py" "$@"
