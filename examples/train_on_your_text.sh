#!/usr/bin/env bash
# Train the tiny quickstart model on your own text.
#   bash examples/train_on_your_text.sh DIR [dotted.key=value ...]
# DIR holds *.txt files. Several files: each file is one document. One file (say input.txt):
# its blank-line-separated paragraphs are the documents. The overrides go to pretrain_gpt.py
# (e.g. train.iters=50). OUT (default data/my_text) and RUN (default runs/my_text) name where
# the token files and the run go.
set -euo pipefail
SRC=${1:?usage: $0 DIR_WITH_TXT_FILES [dotted.key=value ...]}
shift
PY=${PY:-.venv/bin/python}
OUT=${OUT:-data/my_text}
RUN=${RUN:-runs/my_text}
shopt -s nullglob
FILES=("$SRC"/*.txt)
shopt -u nullglob
if [ ${#FILES[@]} -eq 0 ]; then
    echo "error: no *.txt file in $SRC" >&2
    exit 2
fi
if [ ${#FILES[@]} -eq 1 ]; then
    BOUNDARY=blank-line
    echo "[train_on_your_text] one input file: its blank-line-separated paragraphs are the documents (--doc-boundary blank-line)"
else
    BOUNDARY=file
fi
mkdir -p "$OUT"
# 1. a SentencePiece BPE tokenizer on your text (vocab 4096 suits a few MB of text; less text, smaller vocab)
$PY scripts/train_tokenizer.py --input "${FILES[@]}" --vocab-size "${VOCAB:-4096}" --output "$OUT/tokenizer"
# 2. documents -> megatron-core indexed dataset (.bin/.idx)
LOG=$($PY scripts/preprocess_data.py --input "${FILES[@]}" --doc-boundary "$BOUNDARY" \
    --tokenizer "$OUT/tokenizer.model" --output-prefix "$OUT/text_document")
echo "$LOG"
DOCS=$(echo "$LOG" | sed -n 's/.*: \([0-9]*\) documents.*/\1/p')
# 3. validation takes a share of the documents: 2% from 50 documents on, else 10% (at least 4
#    documents are needed: one to validate on)
if [ "${DOCS:-0}" -ge 50 ]; then SPLIT=98,2,0; else SPLIT=90,10,0; fi
$PY pretrain_gpt.py --config configs/quickstart.yaml \
    "data.path=[$OUT/text_document]" data.valid_path=null data.split=$SPLIT \
    data.tokenizer="$OUT/tokenizer.model" data.cache_dir="$OUT/cache" \
    train.iters=200 checkpoint.save_dir="$RUN/checkpoints" logging.dir="$RUN" "$@"
# 4. perplexity of the validation documents (or of any text: --text FILE ...)
echo "evaluate: $PY scripts/evaluate.py --checkpoint $RUN/checkpoints --text ${FILES[*]} --cloze-items 0"
