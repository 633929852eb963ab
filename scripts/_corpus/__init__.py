"""Helpers of scripts/build_corpus.py: text cleaning, sources, and the leak-proof split."""
