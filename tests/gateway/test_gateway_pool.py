"""The target pool against real engine APIs (the simulator's): a slow poll is not a dead target,
NOT_SERVING and a dead server leave at once, an ejected target needs two good polls to return."""

from __future__ import annotations

import dataclasses

from services.gateway.pool import READMIT_AFTER, SLOW_POLLS_TO_LEAVE, TargetPool
from services.gateway.routes_file import TargetSpec
from benchmarks.gateway.simulator.engine import SimSpec
from benchmarks.gateway.simulator.main import serve_engine


async def test_not_serving_and_ejected_targets_leave_and_come_back():
    sim = await serve_engine(SimSpec("s"))
    pool = TargetPool((TargetSpec("s", sim.address),), interval_s=10.0, poll_timeout_s=1.0)
    target = pool.targets["s"]
    try:
        await pool.poll_once(target)
        assert target.state.healthy and target.model_info is not None and target.state.estimator.profile is not None
        await sim.set_serving(False)  # NOT_SERVING: out at once
        await pool.poll_once(target)
        assert not target.state.healthy
        await sim.set_serving(True)
        await pool.poll_once(target)
        assert target.state.healthy  # it left on its own word: one good poll brings it back
        pool.eject(target, "a call failed")
        for _ in range(READMIT_AFTER - 1):
            await pool.poll_once(target)
            assert not target.state.healthy
        await pool.poll_once(target)
        assert target.state.healthy
        await sim.stop(grace=0)  # gone: out at the next poll
        await pool.poll_once(target)
        assert not target.state.healthy
    finally:
        await pool.close()
        await sim.stop(grace=0)


async def test_a_slow_poll_is_not_a_dead_target():
    sim = await serve_engine(SimSpec("s"))
    pool = TargetPool((TargetSpec("s", sim.address),), interval_s=10.0, poll_timeout_s=0.2)
    target = pool.targets["s"]
    try:
        await pool.poll_once(target)
        assert target.state.healthy
        engine = sim.sim_engine
        engine.spec = dataclasses.replace(engine.spec, profile_delay_ms=500)  # GetProfile now times out
        for _ in range(SLOW_POLLS_TO_LEAVE - 1):
            await pool.poll_once(target)
            assert target.state.healthy
        await pool.poll_once(target)
        assert not target.state.healthy
        engine.spec = dataclasses.replace(engine.spec, profile_delay_ms=0)
        await pool.poll_once(target)
        assert target.state.healthy
    finally:
        await pool.close()
        await sim.stop(grace=0)
