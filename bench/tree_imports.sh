#!/usr/bin/env bash
# Makes `import tokenloom.*` work from this source tree with nothing installed (the lent GPU
# machine gets a copy of the tree, installs nothing and has no network): a folder holding a
# `tokenloom` namespace directory of links to the tree's top-level packages, the same mapping
# pyproject.toml's package-dir gives an install. Sourced by bench/gpu_check.sh; prints nothing.
# Sets PYTHONPATH to that folder plus the tree (for `bench.*`).
tree="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
links="${TMPDIR:-/tmp}/tokenloom-tree-imports-$(printf '%s' "$tree" | sha1sum | cut -c1-12)"
mkdir -p "$links/tokenloom"
for package in engine openai_protocol offline settings store worker api cli migrations; do
    ln -sfn "$tree/$package" "$links/tokenloom/$package"
done
export PYTHONPATH="$links:$tree${PYTHONPATH:+:$PYTHONPATH}"
