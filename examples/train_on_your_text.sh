#!/usr/bin/env bash
# Train the tiny quickstart model on your own text files.
#   bash examples/train_on_your_text.sh path/to/dir_with_txt_files
set -euo pipefail
SRC=${1:?usage: $0 DIR_WITH_TXT_FILES}
PY=.venv/bin/python
OUT=data/my_text
mkdir -p "$OUT"
# 1. a SentencePiece BPE tokenizer on your text (vocab 4096 suits a few MB of text)
$PY scripts/train_tokenizer.py --input "$SRC"/*.txt --vocab-size 4096 --output "$OUT/tokenizer"
# 2. one document per file -> megatron-core indexed dataset (.bin/.idx)
$PY scripts/preprocess_data.py --input "$SRC"/*.txt --tokenizer "$OUT/tokenizer.model" \
    --output-prefix "$OUT/text_document"
# 3. train: the quickstart config, pointed at your data; 98% of the documents train, 2% validate
$PY pretrain_gpt.py --config configs/quickstart.yaml \
    data.path=["$OUT/text_document"] data.valid_path=null data.split=98,2,0 \
    data.tokenizer="$OUT/tokenizer.model" data.cache_dir="$OUT/cache" \
    train.iters=200 checkpoint.save_dir=runs/my_text/checkpoints logging.dir=runs/my_text
