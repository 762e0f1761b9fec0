"""Evaluation harness integrations (lm-eval) for trained checkpoints."""
