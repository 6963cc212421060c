"""The on-device agent: what a device of the `orin` pool runs from its own device config (identity.py): the deploy,
one concern per module (fetch, bind, state, keys, spawn, proxy, switch, health, record), boot, log shipping, the
on-device quality probe, reconciliation, and the hardware facts it reports.
"""
