# The two commands (see README): `make run` (main job) and `make test` (test suite).
# Both set up everything they need on a fresh machine first.
.PHONY: setup run test test-fast

setup:
	bash scripts/setup_env.sh

run: setup
	.venv/bin/python tools/run_main_job.py

test: setup
	bash scripts/run_tests.sh

test-fast: setup
	bash scripts/run_tests.sh -m "not slow and not launchers"
