#!/usr/bin/env bash
# Train a draft head (n=3 by default) on one GPU with the real target, inside a short device lease.
#
# The device machine reaches no registry or hub and takes at most 64 MiB per call, so the target
# (the 98 MB GGUF, xz-compressed and split in two by bench/gpu_prepare.sh) travels in two calls:
#   call 1:  mkdir -p /root/spd_stash && cp .gpu_carry1/* /root/spd_stash/ && <a short GPU check>
#            (tree: `bash bench/gpu_tree.sh slim min`; carry .gpu_carry1)
#   call 2:  bash bench/gpu_train.sh        (the same tree; carry .gpu_carry2 and data/self_distill; within 30 s,
#            while the machine is warm). docs/GPU.md, "A training lease, step by step", has the commands and times.
# This script (call 2) rebuilds the GGUF and checks its hash, converts it with the carried tokenizer
# files, writes new self-distillation data with the target on the GPU (GEN_S seconds), trains from
# the carried head on the committed data plus the new data (TRAIN_S seconds, the step count and LR
# decay fitted to it by --time-budget), and leaves in $OUT: the best head (split under the 16 MiB
# per-file limit; join with `cat head.part_* > draft.safetensors`), the new data, and the logs.
# Everything ends within DEADLINE seconds of the start (default 540, under the 600 s a call may run): the training
# budget is cut to what is left after the data, and the new data go to $OUT as soon as they exist.
# The prompt writer is seeded per round: SEEDS must name seeds no committed file used (41 and 42 made
# data/self_distill/gpu_magpie_s41_s42_*, which every run now trains on), or the dedupe drops every new row.
set -uo pipefail
OUT=${OUT:?set OUT to the folder whose files come back}
S=${STASH:-/root/spd_stash}
C=${CARRY:-.gpu_carry2}
GEN_S=${GEN_S:-100}
TRAIN_S=${TRAIN_S:-240}
LR=${LR:-2e-4}
BATCH_TOKENS=${BATCH_TOKENS:-16384}
GEN_BATCH=${GEN_BATCH:-1024}
SEEDS=${SEEDS:-human:43 default:44}   # mix:seed pairs, one prompt writer each, GEN_S shared between them
NUM_STAGES=${NUM_STAGES:-3}
DRAFT_LAYERS=${DRAFT_LAYERS:-3}
TRAIN_FLAGS=${TRAIN_FLAGS:-}  # more spd_fast.train flags, e.g. --fill-after-miss
DEVICE=${DEVICE:-cuda}     # DEVICE=cpu PY=.venv/bin/python with small GEN_S/TRAIN_S/GEN_BATCH: a dry run here
PY=${PY:-python3}
DEADLINE=${DEADLINE:-540}
export PYTHONUNBUFFERED=1 SPD_FAST_CACHE=${SPD_FAST_CACHE:-/root/spd_cache}
t0=$(date +%s)
say() { echo "[gpu_train +$(( $(date +%s) - t0 ))s] $*"; }

$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$C"/gguf-*.whl || { say "pip failed"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD
mkdir -p "$S/init" "$S/tok"
cat "$S"/gguf.xz.part_* "$C"/gguf.xz.part_* | xz -dc > "$S/model.gguf" || { say "cannot rebuild the GGUF"; exit 3; }
if [ "$(sha256sum "$S/model.gguf" | cut -d' ' -f1)" != "$(cat "$C/gguf.sha256")" ]; then
    say "GGUF hash mismatch: a part is missing or damaged"; ls -la "$S" "$C"; exit 3
fi
tar -xJf "$C/init_head.tar.xz" -C "$S/init" && tar -xJf "$C/tok.tar.xz" -C "$S/tok" || exit 3
$PY -c "from pathlib import Path; from spd_fast.store import convert_gguf
print(convert_gguf(Path('$S/model.gguf'), progress=False, tokenizer_from=Path('$S/tok')))" || exit 3
[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
say "target ready"

# 1. new self-distillation data: prompts the target writes itself, greedy 256-token answers
D=data/self_distill
NEW=()
read -r -a SPECS <<< "$SEEDS"
GEN_EACH=$(( GEN_S / ${#SPECS[@]} ))
for spec in "${SPECS[@]}"; do
    set -- ${spec/:/ }
    if [ "$(zcat $D/*.jsonl.gz | grep -c "\"id\": \"magpie-$2-")" -gt 0 ]; then   # -c reads it all: no SIGPIPE
        say "seed $2 already made rows of data/self_distill: set SEEDS to seeds no file used"; exit 2
    fi
    f="$S/gpu_magpie_s$2.jsonl"
    timeout $(( GEN_EACH + 30 )) $PY scripts/self_distill_magpie.py --model "$S/model.gguf" --device "$DEVICE" \
        --dtype bfloat16 --out "$f" --rounds 1000 --batch "$GEN_BATCH" --seed "$2" --mix "$1" --prompt-tokens 64 \
        --max-new-tokens 256 --time-budget "$GEN_EACH" 2>&1 | tail -n 4
    [ -s "$f" ] && NEW+=("$f")
done
DATA=(--data $D/magpie_s9_greedy_256.jsonl.gz --data $D/magpie_s10_t07_256.jsonl.gz
      --data $D/magpie_s12_greedy_256.jsonl.gz --data $D/magpie_s13_t07_256.jsonl.gz
      --data $D/human_s30_greedy_bf16_256.jsonl.gz --data $D/gpu_magpie_s41_s42_greedy_bf16_256.jsonl.gz
      --data $D/human_s45_greedy_80.jsonl.gz --data $D/human_s46_greedy_80.jsonl.gz)
if [ ${#NEW[@]} -gt 0 ]; then
    # no prompt twice, none from the earlier data or the validation set
    if $PY scripts/dedupe_prompts.py "${NEW[@]}" --exclude $D/*.jsonl.gz spd_fast/data/prompts/*.jsonl \
            --out "$S/gpu_new.jsonl.gz"; then
        DATA+=(--data "$S/gpu_new.jsonl.gz")
        split -b 15M "$S/gpu_new.jsonl.gz" "$OUT/gpu_new.jsonl.gz.part_"   # back now: a later kill keeps them
    fi
fi
say "data: ${DATA[*]}"
# 100 s: the trainer's start (model, data) before its --time-budget clock starts, the timeout's slack, the copies
LEFT=$(( DEADLINE - ($(date +%s) - t0) - 100 ))
if [ "$LEFT" -lt "$TRAIN_S" ]; then
    say "TRAIN_S $TRAIN_S cut to $LEFT: DEADLINE $DEADLINE s"
    TRAIN_S=$LEFT
fi
if [ "$TRAIN_S" -lt 60 ]; then
    say "no time left to train (DEADLINE $DEADLINE s); the new data are in \$OUT"; ls -la "$OUT"; exit 4
fi

# 2. train from the carried head; the best head so far goes to $OUT whenever it changes (every 15 s), so a call
# the device tool cuts short (its limit is the device time left) still brings back a head and the log
B="$S/run/best_head"
sync_out() {
    cp "$S/run/train_log.jsonl" "$OUT/" 2>/dev/null
    [ -f "$B/draft.safetensors" ] || return 0
    local m
    m=$(stat -c %Y "$B/draft.safetensors") || return 0
    [ "$m" = "$(cat "$S/synced" 2>/dev/null)" ] && return 0
    rm -f "$OUT"/head.part_*
    split -b 15M "$B/draft.safetensors" "$OUT/head.part_" && cp "$B/draft_config.json" "$OUT/" \
        && { cp "$B/val.json" "$OUT/" 2>/dev/null; echo "$m" > "$S/synced"; }
}
rm -f "$S/synced"
( while sleep 15; do sync_out; done ) &
SYNC_PID=$!
timeout $(( TRAIN_S + 90 )) $PY -m spd_fast.train --model "$S/model.gguf" --device "$DEVICE" --dtype bfloat16 --bf16 \
    --out "$S/run" --init "$S/init" --num-stages "$NUM_STAGES" --draft-layers "$DRAFT_LAYERS" --draft-vocab 16384 "${DATA[@]}" \
    --val $D/val_long_s21_256.jsonl.gz --val-limit 80 --steps 100000 --lr "$LR" --warmup 50 \
    --batch-tokens "$BATCH_TOKENS" --save-every 100 --time-budget "$TRAIN_S" --no-feature-cache --threads 8 $TRAIN_FLAGS \
    2>&1 | grep --line-buffered -v '"step": [0-9]*[1-9]0, "epoch"'   # no `| tail`: a killed pipeline prints nothing
say "training finished (rc ${PIPESTATUS[0]})"
kill "$SYNC_PID" 2>/dev/null
wait "$SYNC_PID" 2>/dev/null

# 3. what comes back (at most 8 files, 16 MiB each): the best head's parts, its config and val.json, the log
rm -f "$S/synced"
sync_out
ls -la "$OUT"
say "done"
