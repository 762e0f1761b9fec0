"""Routing measured on trained models: the probe that reads a layer's routing, score-utility
alignment, mixing interventions, router diversity, expert and per-rank load, and the routing
profile of a checkpoint."""
