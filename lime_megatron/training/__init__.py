"""The trainer of ``pretrain_lime.py``: arguments and the typed run config, the training loop,
optimizer and LR schedule, distributed checkpoints, training data, metrics and profiling."""
