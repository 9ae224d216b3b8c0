"""SIGTERM on a llumlet under load: it stops taking requests, migrates what it runs out live,
hands what is left at the end of its grace period to the gateway to resume, then exits. Nothing
is lost, nothing duplicated."""

from __future__ import annotations

import signal
import subprocess
import time

from tests.chaos.harness import GenerateLog, dead_processes, judge, log_lines, wait_blocks_back
from tests.chaos.test_instance_death import STREAMS, TOKENS, expected, load_with_fault, prompts, resumes_logged


async def _terminate(make_cluster, tiny_model_dir, *llumlet_args: str) -> tuple:
    cluster = make_cluster(3, llumlet_args=llumlet_args)
    victim = "sim-0"
    codes = []
    async with GenerateLog(cluster.nats_url) as orders:
        outcomes, _ = await load_with_fault(cluster, lambda: codes.append(_sigterm(cluster.procs[victim])),
                                            victim, orders)
    # The victim exits on its own once empty (or once its grace is over).
    exit_code = exit_code_within(cluster.procs[victim], 30)
    tally = judge(outcomes, expected(tiny_model_dir, orders, prompts(STREAMS), TOKENS))
    assert not (left := await wait_blocks_back(cluster.nats_url, ["sim-1", "sim-2"])), left
    assert dead_processes(cluster, victim) == []
    return cluster, tally, exit_code, orders


def exit_code_within(proc, timeout_s: float) -> int:
    """The process's exit code; if it is still running after `timeout_s`, the test fails with
    where it hangs (its threads' stacks, from SIGUSR1) and the end of its log."""
    try:
        return proc.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.process.send_signal(signal.SIGUSR1)
        time.sleep(1)
        proc.process.kill()
        raise AssertionError(f"still running {timeout_s:.0f} s after its load ended:\n" + proc.log()[-6000:]) from None


def _sigterm(proc) -> None:
    proc.process.terminate()


async def test_sigterm_migrates_requests_out_before_exiting(make_cluster, tiny_model_dir):
    cluster, tally, exit_code, orders = await _terminate(make_cluster, tiny_model_dir)
    migrated = log_lines(cluster, "sim-0", "migrating")
    print(f"\nSIGTERM (live migration): {tally.line()} resumed {len(orders.resumes)} exit {exit_code}; {migrated[:1]}")
    assert tally.completed == STREAMS and tally.wrong == 0, tally
    assert exit_code == 0
    assert migrated, "the stopping llumlet never tried to migrate its requests out"
    assert len(orders.resumes) <= 2, "SIGTERM should empty the instance by live migration, not by recompute"


async def test_sigterm_without_migration_resumes_by_recompute(make_cluster, tiny_model_dir):
    """No migration possible (off) and no grace: everything it held resumes elsewhere at once."""
    cluster, tally, exit_code, orders = await _terminate(make_cluster, tiny_model_dir, "--no-enable-migration",
                                                         "--stop-grace-s", "0")
    resumed = resumes_logged(cluster)
    print(f"\nSIGTERM (recompute): {tally.line()} resumed {len(orders.resumes)} exit {exit_code} "
          f"resume ms {sorted(resumed)}")
    assert tally.completed == STREAMS and tally.wrong == 0, tally
    assert exit_code == 0
    assert len(orders.resumes) >= 4, "the requests it held should have resumed elsewhere"
