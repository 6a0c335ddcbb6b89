#!/usr/bin/env bash
# The device tool copies the working tree (tracked files and untracked, not-ignored ones) and allows
# 64 MiB per call with the carry. The tracked tree is about 66 MB, over that on its own: the two 28 MB
# weights files of the shipped heads must leave it for every device call (the GPU check uses random heads).
# This script does that on a throwaway branch and undoes it afterwards; the branch you were on and its
# working tree are left as they were.
#   bash bench/gpu_tree.sh slim       # branch gpu-slim: spd_fast/heads untracked and ignored (about 12.6 MB left)
#   bash bench/gpu_tree.sh slim min   # also data/self_distill (about 3.3 MB left): bench/gpu_prepare.sh's call 1
#   bash bench/gpu_tree.sh restore    # back to the branch you came from; gpu-slim deleted
# It prints the bytes that travel (tracked and untracked, not-ignored files) after a slim.
set -euo pipefail
cd "$(dirname "$0")/.."
BR=gpu-slim
EXCL=$(git rev-parse --git-path info/exclude)   # also right in a linked worktree, where .git is a file
STATE=$(git rev-parse --git-path gpu_tree_from)
travelling() { git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1; }
case "${1:-}" in
  slim)
    PATHS=(spd_fast/heads)
    case "${2:-}" in
      "") ;;
      min) PATHS+=(data/self_distill) ;;
      *) echo "usage: bash bench/gpu_tree.sh slim [min] | restore" >&2; exit 2 ;;
    esac
    if [ -f "$STATE" ]; then
        echo "gpu_tree.sh: already slim (on $BR); run 'restore' first" >&2
        exit 2
    fi
    if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
        echo "gpu_tree.sh: commit or stash your changes first (the slim tree is a commit on a throwaway branch)" >&2
        exit 2
    fi
    from=$(git symbolic-ref -q --short HEAD) || {
        echo "gpu_tree.sh: HEAD is detached; check out a branch first (restore comes back to it)" >&2; exit 2; }
    git checkout -q -b "$BR"
    git rm -r -q --cached "${PATHS[@]}"
    for p in "${PATHS[@]}"; do grep -qx "/$p/" "$EXCL" 2>/dev/null || echo "/$p/" >> "$EXCL"; done
    git -c user.name=gpu-tree -c user.email=gpu-tree@localhost commit -q -m "throwaway: ${PATHS[*]} out of the tree for a device call"
    echo "$from $(git rev-parse HEAD) ${PATHS[*]}" > "$STATE"
    echo "on $BR: ${PATHS[*]} stay on disk but out of the device call's tree ($(travelling) bytes travel)"
    ;;
  restore)
    [ -f "$STATE" ] || { echo "gpu_tree.sh: nothing to restore (run 'slim' first)" >&2; exit 2; }
    read -r from commit rest < "$STATE"
    read -r -a PATHS <<< "$rest"
    if [ "$(git rev-parse "$BR")" != "$commit" ]; then  # deleting the branch would drop them
        echo "gpu_tree.sh: $BR has commits made after the slim, which restore would delete; copy them to $from" \
             "(git checkout $from && git cherry-pick $commit..$BR), then git branch -f $BR $commit, and run restore" \
             "again" >&2
        exit 2
    fi
    git checkout -q "$from"   # while the paths are still ignored: git rewrites ignored files, never untracked ones
    for p in "${PATHS[@]}"; do grep -vx "/$p/" "$EXCL" > "$EXCL.tmp" || true; mv "$EXCL.tmp" "$EXCL"; done
    git branch -q -D "$BR"
    rm -f "$STATE"
    git status --short "${PATHS[@]}"
    echo "back on $from"
    ;;
  *)
    echo "usage: bash bench/gpu_tree.sh slim [min] | restore" >&2
    exit 2
    ;;
esac
