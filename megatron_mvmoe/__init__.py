"""megatron_mvmoe: Multi-View MoE, Multi-Router and MH-MoE on Megatron-Core 0.16.1."""

import warnings

__version__ = "0.1.0"

# Megatron-Core warns at import, once per module, that TransformerEngine/Apex are absent
# and it falls back to torch implementations: expected on CPU machines, and a dozen such
# lines per rank drown every tool's progress output. Only these fallback notices are muted.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(are|is) "
                                          r"not installed.*", category=UserWarning)
