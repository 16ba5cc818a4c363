#!/bin/sh
# Run every benchmark with its defaults and keep what docs/performance.md shows:
# the Markdown output of each script and its plots, in bench/results/.
# Usage: sh bench/run_all.sh [PYTHON]      (about fifteen minutes)
set -eu
python="${1:-python}"
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/results"
mkdir -p "$out"
"$python" "$here/overhead.py" --plot "$out" | tee "$out/overhead.md"
"$python" "$here/rate_sweep.py" --plot "$out" | tee "$out/rate_sweep.md"
"$python" "$here/rate_sweep.py" --backends file,redis --procs 4 --intervals 2,1,0.5,0.2 --lead-ms 3 \
    | tee "$out/rate_sweep_lead3.md"
"$python" "$here/peers.py" --plot "$out" | tee "$out/peers.md"
"$python" "$here/begin_gaps.py" --hog 2 --plot "$out" --json "$out/begin_gaps.json" | tee "$out/begin_gaps.md"
"$python" "$here/call_cpu.py" | tee "$out/call_cpu.md"
"$python" "$here/fleet_start.py" --hog 2 | tee "$out/fleet_start.md"
"$python" "$here/check_to_return.py" --hog 2 | tee "$out/check_to_return.md"
"$python" "$here/rate_loss.py" | tee "$out/rate_loss.md"
"$python" "$here/bursts.py" --plot "$out" | tee "$out/bursts.md"
