"""Splits the CPU into 3 logical devices, before TensorFlow starts: import it first.

Every test module that runs TensorFlow imports this (most take `DEVICES` from
it), so that a module run alone gets the same devices as the whole suite;
tests that need no TensorFlow do not import it, and do not start it.
"""

import kerasmulti

DEVICES = 3
kerasmulti.simulate_devices(DEVICES)
