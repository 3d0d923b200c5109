"""Training text for the built-in tiny model's byte-level BPE tokenizer (`corpus.txt`).

The text is original and deliberately mixed: English prose, Python and shell code, JSON,
numbers and dates, French, German, Spanish, Greek, Russian, Chinese, Japanese, Korean,
emoji and mathematical symbols.  The non-Latin parts make the trained vocabulary contain
merges that span multi-byte UTF-8 characters (and tokens holding only part of one), which the
detokenizer tests rely on.

Changing the text changes the tokenizer, so bump ``MODEL_VERSION`` in ``common.tiny.model``
with it.
"""

from __future__ import annotations

from pathlib import Path

# Bytes, not text mode: the corpus holds a "\r\n" that universal newlines would fold.
CORPUS: str = Path(__file__).with_name("corpus.txt").read_bytes().decode("utf-8")
