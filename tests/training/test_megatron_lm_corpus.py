"""Megatron-LM's 63 MoE functional-test lines (core_r0.19.0, tests/assets/megatron_lm_corpus.json,
written by tools/megatron_lm_corpus.py --generate with its one size rule) through this trainer's
flags, no training: each line resolves, or is refused in one pass (one error listing every
refusal) for a reason of tools/megatron_lm_corpus.py's REASONS, a limit of this CPU platform or
a feature this trainer does not build. The counts are docs/megatron_lm.md's; a line that starts
to resolve, or a new kind of refusal, fails here until the doc says so."""

import math
import os

import pytest

import megatron_lm_corpus as corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
RESOLVING = {  # docs/megatron_lm.md: the 38 lines that resolve as written
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_multi_dist_optimizer_instances",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_multi_dist_optimizer_instances"
    "_1node",
    "gpt3_mcore_te_tp1_pp2_resume_torch_dist_reshard_2x1x4_te_8experts2parallel_dist_optimizer",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_dist_optimizer",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer_1node",
    # Muon (replicated, as written) with --check-weight-hash-across-dp-replicas-interval 1
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_muon",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_muon_1node",
    # Muon with the distributed optimizer: Megatron-Core's LayerWiseDistributedOptimizer
    # (test_muon.py), with and without the layer-wise parameter layout
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_1node",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_param_layout",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_param_layout_1node",
    "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer",
    "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic_dp_last",
    "gpt3_mcore_tp2_cp2_pp2_ep2_te_4experts2parallel_dp_last",
    "gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel_dp_last",
    "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic",
    "gpt3_mcore_te_tp1_pp2_resume_torch_dist_reshard_2x1x4_te_8experts2parallel_dist_optimizer_1node",
    "gpt3_mcore_te_tp2_pp1_frozen_resume_torch_dist_te_8experts2parallel_dist_optimizer",
    "gpt3_mcore_te_tp2_pp1_frozen_resume_torch_dist_te_8experts2parallel_groupedGEMM",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_dist_optimizer_1node",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_groupedGEMM",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_top2router",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_ddp_average_in_collective",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_ddp_average_in_collective_1node",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_dist_optimizer",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_overlap_grad_reduce_param_gather_groupedGEMM",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_overlap_grad_reduce_param_gather_groupedGEMM_1node",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_top2router",
    "gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4",
    "gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed",
    "gpt3_mcore_tp2_cp2_pp2_ep2_te_4experts2parallel",
    "gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel",
    "gpt3_mcore_tp2_pp2_ep2_resume_torch_dist_te_4experts2parallel",
    "gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel",
    "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer_1node",
    # Megatron-FSDP with its fsdp_dtensor checkpoints (training/fsdp_checkpoint.py), TP 2 x EP 2
    "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router",
    # --fp16 with dynamic loss scaling, --apply-query-key-layer-scaling, sinkhorn, TP 2 x PP 2
    "gpt3_mcore_tp2_pp2_resume_torch_dist_te_2experts"}
# reason: refused lines that name it (docs/megatron_lm.md, "The functional-test corpus")
REASON_COUNTS = {
    "CUDA graphs / GPU streams / offloading": 14,
    "inference / RL test, not pretraining": 12,
    "FP8 / TransformerEngine": 9,
    "Megatron-FSDP precision options (--megatron-fsdp-*-dtype; FSDP itself trains and saves)": 1,
}


@pytest.fixture(scope="module")
def outcome():
    return corpus.resolve_all(corpus.load_cases())


def test_all_63_lines_resolve_or_are_refused_for_a_named_reason(outcome):
    assert len(outcome) == 63
    assert {name for name, r in outcome.items() if r["resolves"]} == RESOLVING
    counts = {}
    for name, result in outcome.items():
        if not result["resolves"]:
            assert result["refusals"] and not any(
                reason.startswith("other") for reason in result["reasons"]), (name, result)
        for reason in result["reasons"]:
            counts[reason] = counts.get(reason, 0) + 1
    assert counts == REASON_COUNTS


def test_the_docs_table_states_these_counts():
    """docs/megatron_lm.md's table rows, in order, carry REASON_COUNTS (a count changed here
    without the doc, or a row left behind, fails)."""
    with open(os.path.join(ROOT, "docs", "megatron_lm.md")) as f:
        table = f.read().split("| reason a line is refused | lines |\n|---|---|\n")[1]
    rows = table.split("\n\n")[0].strip().splitlines()
    assert [int(row.rsplit("|", 2)[1]) for row in rows] == list(REASON_COUNTS.values())


def test_the_deepseek_style_line_resolves_as_written(outcome):
    """MLA, QK norm, MTP, group-limited sigmoid routing, shared experts at TP 2 x PP 2 x 4
    virtual stages x EP 4: its --num-virtual-stages-per-pipeline-rank was refused first; then
    MTP under PP on CPU (platform/cpu_embedding_copy.py lifted it)."""
    result = outcome["gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed"]
    assert result["resolves"] and not result["refusals"], result


def test_a_resolving_line_keeps_its_layout_shrunk_by_the_rule():
    line = corpus.load_cases()["gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4"]
    run, refusals = corpus.resolve(line)
    assert not refusals
    p = run.parallel
    assert (p.tp, p.pp, p.ep, p.etp) == (2, 1, 4, 1) and corpus.ranks_needed(run) == 4
    assert (run.model.hidden_size, run.model.num_experts, run.model.seq_length,
            run.training.global_batch_size, run.training.train_iters) == (64, 8, 64, 8, 2)


def test_corpus_is_megatron_lms_files_with_only_the_size_rule():
    if not os.path.isdir(MIRROR):
        pytest.skip(f"the Megatron-LM mirror is not on this machine ({MIRROR})")
    fresh = corpus.generate(MIRROR)
    assert fresh["cases"] == corpus.load_cases() and len(fresh["cases"]) == 63


def test_bracketed_values_reach_the_parser_as_megatron_lms_launcher_passes_them():
    """`--recompute-modules: "[moe_act]"` in a model_config.yaml reaches Megatron-LM's parser
    as `--recompute-modules moe_act` (its launcher strips the brackets and splits the words),
    so the corpus line carries the words and this trainer's parser takes them."""
    assert corpus.launcher_words("[layernorm mla_up_proj mlp moe_act]") == [
        "layernorm", "mla_up_proj", "mlp", "moe_act"]
    assert corpus.launcher_words("([0]*3+[1]*13)") == ["([0]*3+[1]*13)"]
    assert corpus.launcher_words("Et*3|(tt|)*6tmL") == ["Et*3|(tt|)*6tmL"]
    line = corpus.load_cases()["gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph"]
    at = line.index("--recompute-modules")
    assert line[at + 1:at + 3] == ["moe_act", "--cuda-graph-impl"]
    _, refusals = corpus.resolve(line)
    assert refusals and not any("--recompute-modules" in r for r in refusals), refusals


def test_the_bracket_rule_is_megatron_lms_launchers():
    if not os.path.isdir(MIRROR):
        pytest.skip(f"the Megatron-LM mirror is not on this machine ({MIRROR})")
    script = corpus._git(MIRROR, "show", f"{corpus.COMMIT}:tests/functional_tests/"
                         "shell_test_utils/_run_training.sh")
    assert "grep -Eq '^\\[[^]]+\\]$'" in script and "sed 's/^\\[//;s/\\]$//'" in script
    assert 'TRAINING_PARAMS_FROM_CONFIG+="$key $value "' in script  # unquoted: eval splits


TRAINED_IN_CI = ("gpt3_mcore_te_tp1_pp2_resume_torch_dist_reshard_2x1x4_te_8experts2parallel_"
                 "dist_optimizer_1node")
"""The corpus line trained in the suite (docs/megatron_lm.md): GPT-3 as written (GeLU,
LayerNorm, learned positions, tied embeddings at PP 2), PP 2 x EP 2, the distributed
optimizer, 4 ranks. (test_megatron_lm_script.py trains the top-2 GPT-3 line at EP 2 with its
GPT-2 data; `tools/megatron_lm_corpus.py --train` trains every resolving line.)"""


def test_a_representative_line_trains_two_steps_as_written(tmp_path):
    result = corpus.train_one(TRAINED_IN_CI, corpus.load_cases()[TRAINED_IN_CI], 4, 600,
                              log_dir=str(tmp_path))
    assert result["rc"] == 0 and result["last_loss"] is not None, result
    with open(result["log"]) as f:  # the whole output kept, so a failure can be read
        assert result["last_loss"] in f.read()
    # a fresh model: near ln 640 (NullTokenizer's 513 ids padded to 640 rows at TP 1)
    assert abs(float(result["last_loss"]) - math.log(640)) < 1.0, result


def test_the_docs_trained_table_has_one_row_per_line_and_states_its_count():
    """docs/megatron_lm.md's `--train` table: each row a resolving line, none twice, and the
    sentence above it states the row count (a renamed line, a row added twice or a count not
    updated fails)."""
    with open(os.path.join(ROOT, "docs", "megatron_lm.md")) as f:
        doc = f.read()
    head = "| case | ranks | outcome | last loss printed | s |\n|---|---|---|---|---|\n"
    rows = doc.split(head)[1].split("\n\n")[0].strip().splitlines()
    cases = [row.split("|")[1].split()[0] for row in rows]
    assert set(cases) <= RESOLVING and len(set(cases)) == len(cases)
    assert all("| trained 2 steps |" in row for row in rows)
    assert f"{len(cases)} of the {len(RESOLVING)} resolving lines trained 2 steps" in doc


def test_ranks_needed_lets_the_instances_divide_the_expert_data_parallel_size():
    """The multi_dist_optimizer_instances line (TP 2 = ETP 2 x EP 2, 2 instances) needs 8 ranks
    (expert DP 2), not 4 (DP 2 but expert DP 1, which Megatron-Core refuses)."""
    name = "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_multi_dist_optimizer_instances"
    run, refusals = corpus.resolve(corpus.load_cases()[name])
    assert not refusals and corpus.ranks_needed(run) == 8


def test_every_resolving_line_trains_within_the_default_max_ranks(outcome):
    """docs/megatron_lm.md: `--train` with its default --max-ranks trains every resolving
    line (none is skipped for its ranks); the largest layouts need 8."""
    ranks = [r["ranks"] for r in outcome.values() if r["resolves"]]
    assert max(ranks) == corpus.MAX_RANKS == 8, sorted(ranks)
