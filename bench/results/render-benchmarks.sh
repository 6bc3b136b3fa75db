#!/usr/bin/env bash
# Renders docs/benchmarks.md from the runs of record (bench/make_report.py) and draws its plots
# in docs/benchmarks/ from their rows (matplotlib; without it the page keeps the plots it has):
# edit the run list and bench/results/benchmarks-note.md when a new run of record lands (its
# results.json and results.md; not its plots).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
python3 bench/make_report.py \
  bench/results/h200-2026-12-01j/full:fa-grid,head-dims,lse-overhead,host-overhead \
  bench/results/h100-2026-12-05/varlen \
  bench/results/h200-2026-12-02b/decode \
  bench/results/h200-2026-12-04g/serving \
  bench/results/h200-2026-12-04e/decode-fp8 \
  bench/results/h200-2026-12-04f/fwd-fp8 \
  --allow-partial \
  --append bench/results/h200-2026-12-04e/train \
  --append bench/results/h100-2026-12-05b/train \
  --append bench/results/h100-2026-12-05c/train \
  --append bench/results/h200-2026-12-05b/train \
  --append bench/results/h100-2026-12-06b/train \
  --append bench/results/h100-2026-12-06c/train \
  --append bench/results/h200-2026-12-06/train \
  --append bench/results/h100-2026-12-07/train \
  --append bench/results/h100-2026-12-07e/train \
  --append bench/results/h100-2026-12-07f/fwd-fp8 \
  --append bench/results/h200-2026-12-04/merge \
  --append bench/results/h200-2026-12-06/generate \
  --note-file bench/results/benchmarks-note.md
