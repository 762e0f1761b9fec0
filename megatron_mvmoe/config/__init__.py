"""Configuration and command line, at the bottom of the house: the run config and its
typed loader, the model section, the preset registry, the variant records, our Megatron
config (`MVMoETransformerConfig`, MLA's), and the flag tables (ours, Megatron-LM's
accepted and refused flags). Imports nothing from models/, training/ or analysis/
(tests/test_dependency_rules.py); the Megatron config of a run for its layout is built
once above it (models/build.py)."""
