import asyncio

from ray_ckpt.control.admission import AdmissionGate


async def test_gate_waits_for_reopen_and_never_suspends_when_open() -> None:
    gate = AdmissionGate()
    assert gate.is_open
    # Open: awaiting does not yield, so no other task runs in between.
    ran: list[str] = []

    async def mark() -> None:
        ran.append("other")

    other = asyncio.create_task(mark())
    await gate.wait_open()
    assert ran == []
    await other
    gate.close()
    waiter = asyncio.create_task(gate.wait_open())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    # Reopened and closed again before the waiter ran: it keeps waiting.
    gate.open()
    gate.close()
    await asyncio.sleep(0.01)
    assert not waiter.done()
    gate.open()
    await asyncio.wait_for(waiter, 1)
