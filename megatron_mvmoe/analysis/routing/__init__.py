"""Routing measured on trained models: the probe that reads a layer's routing, score-utility
alignment, mixing interventions, expert and per-rank load, and the routing profile of a checkpoint
(router diversity is pure math, in functional/diversity.py, which the trainer logs too)."""
