"""Trained models in and out: any-layout checkpoints into one process, Hugging Face layouts, export
and import."""
