"""megatron_mvmoe: Multi-View MoE, Multi-Router and MH-MoE on Megatron-Core 0.19.2."""

from megatron_mvmoe import log_noise

__version__ = "0.1.0"

# Before Megatron-Core and torch print their import-time notices: each message hidden is
# named, with its reason, in log_noise.py.
log_noise.install()
