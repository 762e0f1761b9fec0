"""stopping.py's launcher watch, without a launch: a rank whose parent is gone asks every
rank to stop (the flag rides in the per-step all-reduce); a plain `python -m` is not
watched. The real thing (plain torchrun, its agent killed by SIGUSR1) is
tests/launch/test_torchrun_signals.py::test_usr1_to_a_plain_torchrun_group_saves_and_leaves_no_orphan."""

import os

from megatron_mvmoe.training.stopping import StopConditions, StopFlags, launcher_pid


def test_a_rank_whose_launcher_is_gone_stops_after_the_step():
    watched = StopConditions(None, None, launcher_pid=os.getppid())
    assert watched.local_flags().launcher_gone == 0.0
    orphan = StopConditions(None, None, launcher_pid=os.getppid() + 1)  # not our parent
    flags = orphan.local_flags()
    assert flags.as_list() == [0.0, 0.0, 1.0]
    assert orphan.reason(5, StopFlags(*flags.as_list())).startswith("the launcher exited")


def test_only_launched_ranks_watch_their_parent():
    assert launcher_pid({}) is None  # a shell's child: its nohup'd parent may go
    for env in ({"RANK": "0"}, {"SLURM_PROCID": "1"}, {"OMPI_COMM_WORLD_RANK": "0"}):
        assert launcher_pid(env) == os.getppid(), env
