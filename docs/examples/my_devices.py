"""A device-model feature from your own module: diurnal availability.  Client
c is online while its local hour, (t / 3600 + 3 c) mod 24, lies in [8, 20);
a training takes ``step_s`` simulated seconds a local step and never drops
out.  Anything with these three methods (``engine/clock/devices.py``'s
``Devices``) drives the synchronous round's plan and the asynchronous clock."""
from rayfed_dg.engine.clock.devices import Devices


class Diurnal(Devices):
    def __init__(self, step_s: float = 30.0):
        self.step_s = step_s

    def duration(self, client: int, steps: int, draw: int) -> float:
        return steps * self.step_s

    def available(self, client: int, t: float) -> bool:
        return 8 <= (t / 3600 + 3 * client) % 24 < 20

    def drops(self, client: int, draw: int) -> bool:
        return False
