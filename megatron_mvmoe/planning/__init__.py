"""The planner: parameters, FLOPs and memory per rank of a model on a layout, before anything
is built (plan.py, memory.py, context_parallel.py), and the check of a plan against a run's
measured memory census (validate.py). Below training, which refuses a layout that does not
fit at start-up, and analysis/tools, which print plans (tools/plan.py)."""
