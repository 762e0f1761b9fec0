"""Megatron-LM's --check-weight-hash-across-dp-replicas-interval N: every N steps the
data-parallel replicas compare parameter hashes with Megatron-Core's
check_param_hashes_across_dp_replicas(model, cross_check=True); a match logs Megatron-LM's
line, a mismatch stops the run naming the step (training/weight_hash_check.py)."""

import pytest

from megatron_mvmoe.testing.spawn import DistributedTestError


def _run(text_tokens):
    from harness import tiny_run

    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=2, eval_iters=0)
    # Replicated optimizer (as on the corpus's Muon lines): ZeRO-1 would overwrite the
    # desynchronised weight with its all-gathered shard after the step, hiding the fault.
    raw["optimizer"].update(warmup_iters=0, use_distributed_optimizer=False)
    raw["training"]["check_weight_hash_interval"] = 1
    return raw


def test_two_replicas_log_that_their_weights_match_every_step(text_tokens, capfd):
    from harness import train

    train(_run(text_tokens), 2)
    out = capfd.readouterr().out
    assert ">>> Weight hashes match after 1 iterations..." in out
    assert ">>> Weight hashes match after 2 iterations..." in out


def test_a_desynchronised_replica_stops_the_run_naming_the_step(text_tokens):
    from harness import train

    with pytest.raises(DistributedTestError, match=r"replicas' weights differ after step 2\b"
                                                   r".*Fix: "):
        train(_run(text_tokens), 2, hook=("desync", 2, 1))


def test_the_flag_sets_the_interval():
    from megatron_mvmoe.config.flags import config_from_args

    run = config_from_args(["--model-preset", "tiny_smoe",
                            "--check-weight-hash-across-dp-replicas-interval", "3"])
    assert run.training.check_weight_hash_interval == 3
