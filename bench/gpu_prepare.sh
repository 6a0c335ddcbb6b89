#!/usr/bin/env bash
# Pack what bench/gpu_train.sh needs into two carry folders, each of which fits one device call (64 MiB with the
# working tree that travels with it): .gpu_carry1 = the first part of the xz-compressed GGUF, sized to what is
# left beside the `bash bench/gpu_tree.sh slim min` tree (call 1); .gpu_carry2 = the rest, its sha256, the head
# to start from, the tokenizer files of the local conversion and the `gguf` wheel (the device machine has no
# registry), carried in call 2 with data/self_distill (ignored in that tree, so carry can name it). Both folders
# are git-ignored through .git/info/exclude. It refuses to finish when either call would not fit. The whole
# recipe, with its time plan: docs/GPU.md, "A training lease, step by step".
#   Usage: bash bench/gpu_prepare.sh [HEAD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
INIT=${1:-spd_fast/heads/smollm2-135m-instruct-n3}
PY=${PY:-.venv/bin/python}
[ -f "$INIT/draft.safetensors" ] || { echo "gpu_prepare.sh: $INIT holds no draft.safetensors of its own; pass a head directory that does (the shipped n=2 head reads the n=3 head's file)" >&2; exit 2; }
G=$($PY -c "from spd_fast.store import default_gguf_path; print(default_gguf_path())")
TOK=$($PY -c "from spd_fast.store import convert_gguf, default_gguf_path; print(convert_gguf(default_gguf_path(), progress=False))")
EXCL=$(git rev-parse --git-path info/exclude)
for d in .gpu_carry1 .gpu_carry2; do
    grep -qx "/$d/" "$EXCL" 2>/dev/null || echo "/$d/" >> "$EXCL"
    rm -rf "$d"; mkdir -p "$d"
done
LIMIT=$((64 * 1024 * 1024)); MARGIN=$((1024 * 1024))
# bytes that travel in each call: tracked and untracked, not-ignored files, less what gpu_tree.sh takes out
tree_bytes() { git ls-files -z --cached --others --exclude-standard -- . "$@" | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1; }
TREE1=$(tree_bytes ':(exclude)spd_fast/heads' ':(exclude)data/self_distill')
TREE2=$(tree_bytes ':(exclude)spd_fast/heads')
PART1=$((LIMIT - MARGIN - TREE1))
tmp=$(mktemp -d)
xz -6 -T2 -c "$G" > "$tmp/gguf.xz"
split -b "$PART1" "$tmp/gguf.xz" "$tmp/gguf.xz.part_"
mv "$tmp/gguf.xz.part_aa" .gpu_carry1/
mv "$tmp"/gguf.xz.part_a[b-z] .gpu_carry2/
sha256sum "$G" | cut -d' ' -f1 > .gpu_carry2/gguf.sha256
tar -cJf .gpu_carry2/init_head.tar.xz -C "$INIT" draft.safetensors draft_config.json
tar -cJf .gpu_carry2/tok.tar.xz -C "$TOK" $(cd "$TOK" && ls tokenizer.json tokenizer_config.json chat_template.jinja 2>/dev/null)
$PY -m pip download -q --no-deps --only-binary=:all: -d .gpu_carry2 "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
rm -rf "$tmp"
C1=$(du -cb .gpu_carry1 | tail -1 | cut -f1); C2=$(du -cb .gpu_carry2 | tail -1 | cut -f1)
echo "call 1 (tree of bash bench/gpu_tree.sh slim min, carry .gpu_carry1): $TREE1 + $C1 = $((TREE1 + C1)) of $LIMIT bytes"
echo "call 2 (the same tree, carry .gpu_carry2 and data/self_distill): $TREE2 + $C2 = $((TREE2 + C2)) of $LIMIT bytes"
for pair in "1 $((TREE1 + C1))" "2 $((TREE2 + C2))"; do
    set -- $pair
    if [ "$2" -gt $((LIMIT - MARGIN / 2)) ]; then
        echo "gpu_prepare.sh: call $1 would carry $2 bytes, over the device call's $LIMIT: take files out of its tree" \
             "(untracked files count too) or start from a smaller head" >&2
        exit 2
    fi
done
