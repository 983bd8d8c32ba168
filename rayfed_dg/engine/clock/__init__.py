"""The simulated clock: the device model (speeds, availability, dropout, a
synchronous round's plan on its clock) and the event simulation of the
asynchronous server modes.  Pure: no Ray, no wall time, no I/O.

May import: no other wing.
"""
MAY_IMPORT: tuple[str, ...] = ()
