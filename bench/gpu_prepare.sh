#!/usr/bin/env bash
# Pack what bench/gpu_train.sh needs into two carry folders, each small enough for one device call
# (64 MiB with the working tree): .gpu_carry1 = the first 58 MiB of the xz-compressed GGUF;
# .gpu_carry2 = the rest, its sha256, the head to start from, the tokenizer files of the local
# conversion and the `gguf` wheel (the device machine has no registry). Both folders are git-ignored
# through .git/info/exclude.   Usage: bash bench/gpu_prepare.sh [HEAD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
INIT=${1:-spd_fast/heads/smollm2-135m-instruct-n3}
PY=${PY:-.venv/bin/python}
[ -f "$INIT/draft.safetensors" ] || { echo "gpu_prepare.sh: $INIT holds no draft.safetensors of its own; pass a head directory that does (the shipped n=2 head reads the n=3 head's file)" >&2; exit 2; }
G=$($PY -c "from spd_fast.store import default_gguf_path; print(default_gguf_path())")
TOK=$($PY -c "from spd_fast.store import convert_gguf, default_gguf_path; print(convert_gguf(default_gguf_path(), progress=False))")
for d in .gpu_carry1 .gpu_carry2; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
    rm -rf "$d"; mkdir -p "$d"
done
tmp=$(mktemp -d)
xz -6 -T2 -c "$G" > "$tmp/gguf.xz"
split -b 58M "$tmp/gguf.xz" "$tmp/gguf.xz.part_"
mv "$tmp/gguf.xz.part_aa" .gpu_carry1/
mv "$tmp"/gguf.xz.part_a[b-z] .gpu_carry2/
sha256sum "$G" | cut -d' ' -f1 > .gpu_carry2/gguf.sha256
tar -cJf .gpu_carry2/init_head.tar.xz -C "$INIT" draft.safetensors draft_config.json
tar -cJf .gpu_carry2/tok.tar.xz -C "$TOK" $(cd "$TOK" && ls tokenizer.json tokenizer_config.json chat_template.jinja 2>/dev/null)
$PY -m pip download -q --no-deps --only-binary=:all: -d .gpu_carry2 "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
rm -rf "$tmp"
du -sh .gpu_carry1 .gpu_carry2
