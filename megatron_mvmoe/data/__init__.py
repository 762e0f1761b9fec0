"""Data pipeline: offline corpus -> tokenizer -> Megatron .bin/.idx -> GPTDataset batches.

Modules (imported explicitly; this package imports nothing heavy on its own):
- sources.py     readers of the real text sources (books, reference, tech)
- corpus.py      JSONL train/valid/test splits by document hash, manifest.json
- tokenize.py    GPT-2 BPE and a small trained byte-level BPE behind one Tokenizer
- indexed.py     writing and checking Megatron indexed datasets, dataset metadata
- preprocess.py  corpus -> one .bin/.idx per domain and split
- loader.py      Megatron BlendedMegatronDatasetBuilder/GPTDataset, microbatch iterators
- dali_loader.py optional NVIDIA DALI backend for the same microbatches
- run_data.py    a run's tokenizer and its train / per-domain eval microbatch streams
                 (the trainer's data and the analysis tools' held-out batches)
- errors.py      DataError: user-fixable problems, naming the file and the fix
"""
