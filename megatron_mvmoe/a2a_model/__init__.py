"""The all-to-all byte model: from a routing map and an EP placement, the bytes every
dispatch semantic (row, rank, node) puts on each link, payload and bookkeeping
(docs/a2a_model.md). Pure (torch, config.variants, functional): the trainer's live metrics
(training/a2a_metrics.py), the analysis tools and their checks all use this one model."""
