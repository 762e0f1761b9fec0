"""Pretraining: run config + flags, model/optimizer build, the loop, checkpoints, logs."""
