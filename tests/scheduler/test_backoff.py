"""The reconnect loop every backend link runs: doubling delays up to a cap, and a stop."""

from services.scheduler.links.backoff import retry_until_connected


async def test_the_delay_doubles_up_to_its_cap_until_the_backend_answers():
    tries, delays = [], []

    async def connect():
        tries.append(len(tries))
        if len(tries) < 5:
            raise ConnectionError("refused")

    connected = await retry_until_connected(connect, first_delay_s=0.001, max_delay_s=0.004,
                                            failed=lambda exc, delay: delays.append(delay))
    assert connected and len(tries) == 5
    assert delays == [0.001, 0.002, 0.004, 0.004]


async def test_a_stop_ends_the_retries_without_a_connection():
    failures = []

    async def connect():
        raise ConnectionError("refused")

    connected = await retry_until_connected(connect, first_delay_s=0.001, max_delay_s=0.001,
                                            failed=lambda exc, delay: failures.append(str(exc)),
                                            stopped=lambda: len(failures) >= 3)
    assert not connected and failures == ["refused"] * 3
