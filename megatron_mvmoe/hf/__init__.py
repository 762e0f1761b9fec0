"""Hugging Face interoperability (issue 23): export a checkpoint of any variant and layout
to a transformers directory, and import one back.

- config_map: which class (Llama / Mixtral / Qwen3Moe / Glm4Moe where they compute the model
  exactly, else our MVMoEForCausalLM through auto_map) and its config.json, field by field
- names: Megatron state dict <-> the class's weight names and layouts
- writer: atomic directory, sharded safetensors + index, tokenizer, remote code
- export: checkpoint -> directory; importer: directory -> checkpoint
- remote/: configuration_mvmoe.py, modeling_mvmoe.py, basic_layers.py, moe_layers.py and
  mla_attention.py (writer.REMOTE_FILES), copied into exported directories
  with the functional/ files they import (they import nothing from Megatron or this package)
"""
