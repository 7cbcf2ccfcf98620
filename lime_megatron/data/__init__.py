"""Tokenizers and corpora for the data tools and the trainer."""
