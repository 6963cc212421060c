"""The on-device agent: what a device of the `orin` pool runs from its own device config (identity.py): the deploy
(deploy.py: fetch, bind, switch, health, records), boot, log shipping, the on-device quality probe, reconciliation, and
the hardware facts it reports.
"""
