"""One rank's failure in a worker group's rounds, on two gloo ranks (no Ray): nobody waits for a collective
that will never come.

A rank whose loss alone is not finite ends the run on both ranks, which agree and go on to the group's
other runs; a rank that raises alone while its peer waits for it in a collective gives up on the group
after ``train.failure_timeout_s`` (Ray then tears the group down; tests/ray/one_instance/test_trainer.py shows the
sweep's side).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from rayvit.config import load_config

from helpers_two_ranks import two_ranks

SMALL = ["train.batch_size=4", "model.depth=2", "train.steps=4", "train.warmup_steps=1", "parallel.num_workers=2"]
FAULT = {"train.fail_at_step": 2, "train.fail_rank": 1, "train.failure_timeout_s": 3}
# The process group's timeout: a collective that never completes fails after it, so a regression fails
# these tests within a minute instead of hanging them for torch's default 30.
GROUP_TIMEOUT_S = 60
# Short enough that, unfixed, the stale collective fails each healthy config within seconds.
OUT_OF_STEP_TIMEOUT_S = 15


def _noting_abandon(folder: str, rank: int):
    """An ``on_abandon`` hook that writes what this rank posted to ``abandoned<rank>.json``."""
    def abandoned(index, r, slot, error):
        Path(folder, f"abandoned{rank}.json").write_text(json.dumps([index, r, slot, error]))
    return abandoned


def _rounds_with_a_fault_on_rank_1(rank: int, mode: str, folder: str) -> tuple[list, float]:
    """Three configs in two rounds, the second failing on rank 1 only; (outcomes, seconds)."""
    from rayvit.worker.rounds import measure_rounds

    ok = load_config(overrides=SMALL)
    broken = ok.replace({**FAULT, "train.fail_mode": mode})
    start = time.monotonic()
    outcomes = measure_rounds([ok, broken, ok.replace({"parallel.strategy": "fsdp"})], 2,
                              on_abandon=_noting_abandon(folder, rank))
    return outcomes, time.monotonic() - start


def _rounds_with_rank_1_ahead_in_the_first(rank: int, folder: str) -> dict:
    """Three configs in one round: in the first (ddp) rank 1 issues one more collective than rank 0 (an async
    all-reduce, as a host that ran ahead of its peers under NCCL) and both ranks raise at step 2; then a
    healthy ddp and a healthy fsdp config. What each rank recorded and raised, and when."""
    from rayvit.worker.agree import GroupAbandoned
    from rayvit.worker.rounds import measure_rounds

    def fail_first(session, index, r):
        if index == 0 and session.step == 2:
            if rank == 1:
                dist.all_reduce(torch.zeros(1), async_op=True)
            raise RuntimeError(f"the first config fails on rank {rank}")

    start = time.monotonic()
    recorded = []
    ok = load_config(overrides=[*SMALL, "train.failure_timeout_s=3"])
    seen = {"recorded": recorded, "outcomes": None, "raised": None}
    try:
        seen["outcomes"] = measure_rounds(
            [ok, ok, ok.replace({"parallel.strategy": "fsdp"})], 1, on_step=fail_first,
            on_round=lambda index, r, slot, result, error: recorded.append((index, error, time.monotonic() - start)),
            on_abandon=_noting_abandon(folder, rank))
    except GroupAbandoned as e:
        seen["raised"] = str(e)
    seen["seconds"] = time.monotonic() - start
    return seen


def _rounds_losing_rank_1(rank: int, folder: str) -> str:
    """Two configs in one round; rank 1's process exits in the second (as a lost worker): what rank 0 raised."""
    from rayvit.worker.agree import GroupAbandoned
    from rayvit.worker.rounds import measure_rounds

    ok = load_config(overrides=SMALL)
    try:
        measure_rounds([ok, ok.replace({**FAULT, "train.fail_mode": "exit"})], 1,
                       on_abandon=_noting_abandon(folder, rank))
    except GroupAbandoned as e:
        return str(e)
    return "finished"


def test_a_rank_whose_peer_is_lost_ends_the_group_without_failing_the_run(tmp_path):
    """Rank 1's process exits mid-run: rank 0's collective fails (gloo: connection reset by peer), rank 1
    never answers, and rank 0 ends the group after train.failure_timeout_s, without reporting the run as
    failed: the run did nothing wrong, its group lost a worker, so the sweep measures it again alone."""
    from rayvit.worker.agree import lost_a_peer

    ranks = two_ranks(tmp_path, _rounds_losing_rank_1, str(tmp_path), timeout_s=GROUP_TIMEOUT_S, join=False)
    for process in ranks:
        process.join(timeout=GROUP_TIMEOUT_S)
    assert [p.exitcode for p in ranks] == [0, 70]
    raised = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert raised.startswith("rank 1 did not answer within 3 s") and lost_a_peer(raised), raised
    assert not list(tmp_path.glob("abandoned*"))
    assert not lost_a_peer("InjectedFault: injected fault on rank 1 at step 2") and not lost_a_peer(None)


def test_a_loss_not_finite_on_one_rank_fails_the_run_on_both_and_the_rounds_go_on(tmp_path):
    (out0, seconds0), (out1, seconds1) = two_ranks(tmp_path, _rounds_with_a_fault_on_rank_1, "nan", str(tmp_path),
                                                   timeout_s=GROUP_TIMEOUT_S)
    # Both ranks record the same failure, word for word, within the minute.
    assert out0[1]["error"] == out1[1]["error"]
    assert "DivergedError: loss is not finite (NaN or inf) on rank 1 at step 3" in out0[1]["error"]
    assert out0[1]["rounds"] == [] and max(seconds0, seconds1) < 60
    # The other runs were measured in both rounds, on both ranks, the failed one out of round 2.
    for out in (out0, out1):
        for i in (0, 2):
            assert out[i]["error"] is None and len(out[i]["rounds"]) == 2
        assert out[2]["places"] == [(0, 2), (1, 0)]
    assert not list(tmp_path.glob("abandoned*"))


def test_a_rank_that_raises_alone_gives_up_on_the_group_instead_of_waiting_for_it(tmp_path):
    """Rank 0 waits for rank 1 in the step's gradient all-reduce, forever: rank 1 posts its error, says
    so, and raises after train.failure_timeout_s (3 s here); the process holding rank 0 is then ended
    (here by torch.multiprocessing, under Ray by Ray Train)."""
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException) as raised:
        two_ranks(tmp_path, _rounds_with_a_fault_on_rank_1, "raise", str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    assert time.monotonic() - start < 60
    text = str(raised.value)
    assert "Process 1 terminated" in text and "GroupAbandoned: rank 0 did not answer within 3 s" in text
    assert "train.failure_timeout_s=3" in text and "InjectedFault: injected fault on rank 1 at step 2" in text
    index, r, slot, error = json.loads((tmp_path / "abandoned1.json").read_text())
    assert (index, r, slot) == (1, 0, 1) and "injected fault on rank 1 at step 2" in error
    assert not (tmp_path / "abandoned0.json").exists()


def test_a_failure_that_leaves_the_ranks_collectives_out_of_step_ends_the_group(tmp_path):
    """Both ranks fail the first config, rank 1 one collective ahead of rank 0 (it issued an all-reduce rank 0
    never will). They agree on the failure, and see from their collective counts that the group is out of
    step: every rank ends it at once, the first config recorded failed with its error, so that the healthy
    configs after it are measured in groups of their own instead of failing against a stale collective
    after the process group's timeout."""
    seen = two_ranks(tmp_path, _rounds_with_rank_1_ahead_in_the_first, str(tmp_path), timeout_s=OUT_OF_STEP_TIMEOUT_S)
    for rank, s in enumerate(seen):
        # Before: the first config was recorded failed, then ddp and fsdp failed on a stale collective
        # ("Connection closed by peer") after the group's timeout, and were never measured again.
        assert s["outcomes"] is None, (rank, [(i, (e or "").strip().splitlines()[-1:]) for i, e, _ in s["recorded"]])
        counts = re.search(r"process group '0': rank 0 issued (\d+) collectives, rank 1 (\d+)\)", s["raised"])
        assert counts and int(counts[2]) == int(counts[1]) + 1, s["raised"]
        assert s["raised"].rstrip().endswith("RuntimeError: the first config fails on rank 0")
        assert [index for index, _, _ in s["recorded"]] == [] and s["seconds"] < OUT_OF_STEP_TIMEOUT_S, s
    # The failure reached the sweep once, from rank 0, with the error both ranks agreed on.
    index, r, slot, error = json.loads((tmp_path / "abandoned0.json").read_text())
    assert (index, r, slot) == (0, 0, 0) and "the first config fails on rank 0" in error
    assert not (tmp_path / "abandoned1.json").exists()
