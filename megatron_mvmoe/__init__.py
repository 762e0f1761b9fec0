"""megatron_mvmoe: Multi-View MoE, Multi-Router and MH-MoE on Megatron-Core 0.16.1."""

__version__ = "0.1.0"
