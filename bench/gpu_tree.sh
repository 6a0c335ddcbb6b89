#!/usr/bin/env bash
# The device tool copies the working tree (tracked files and untracked, not-ignored ones) and allows
# 64 MiB per call with the carry. The shipped heads are 28 MB, so the calls that carry the model
# (bench/gpu_prepare.sh, parts of 58 MB) need them out of the tree. This script does that on a throwaway branch and
# undoes it afterwards; main and its working tree are left as they were.
#   bash bench/gpu_tree.sh slim      # branch gpu-slim: spd_fast/heads untracked and ignored
#   bash bench/gpu_tree.sh restore   # back to the branch you came from; gpu-slim deleted
set -euo pipefail
cd "$(dirname "$0")/.."
BR=gpu-slim
EXCL=.git/info/exclude
LINE=/spd_fast/heads/
case "${1:-}" in
  slim)
    if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
        echo "gpu_tree.sh: commit or stash your changes first (the slim tree is a commit on a throwaway branch)" >&2
        exit 2
    fi
    git rev-parse --abbrev-ref HEAD > .git/gpu_tree_from
    git checkout -q -b "$BR"
    git rm -r -q --cached spd_fast/heads
    grep -qx "$LINE" "$EXCL" 2>/dev/null || echo "$LINE" >> "$EXCL"
    git -c user.name=gpu-tree -c user.email=gpu-tree@localhost commit -q -m "throwaway: shipped heads out of the tree for a device call"
    echo "on $BR: the heads stay on disk but are out of the device call's tree ($(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes tracked)"
    ;;
  restore)
    [ -f .git/gpu_tree_from ] || { echo "gpu_tree.sh: nothing to restore (run 'slim' first)" >&2; exit 2; }
    from=$(cat .git/gpu_tree_from)
    git checkout -q "$from"   # while the heads are still ignored: git rewrites ignored files, never untracked ones
    grep -vx "$LINE" "$EXCL" > "$EXCL.tmp" || true
    mv "$EXCL.tmp" "$EXCL"
    git branch -q -D "$BR"
    rm -f .git/gpu_tree_from
    git status --short spd_fast/heads
    echo "back on $from"
    ;;
  *)
    echo "usage: bash bench/gpu_tree.sh slim|restore" >&2
    exit 2
    ;;
esac
